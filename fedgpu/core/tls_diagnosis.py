"""Why a connection to an aggregator fails, in one line that names the cause and the fix.

gRPC reports every TLS failure as UNAVAILABLE with a detail such as "Socket closed" or "Ssl
handshake failed": from the client a certificate with the wrong names, an expired one, a
refused client certificate and a dead server look alike. So when a call fails that way we look
ourselves: a TCP connection to the address, a TLS handshake with Python's `ssl` (once without
verification, to see what the server presents; once as gRPC would verify it), and, when the
port does not speak TLS or gRPC, a look at what does answer there (a plaintext gRPC server,
the aggregator's bulk port, an HTTP server such as the dashboard or the metrics port).

One module for the node, `fedgpu doctor` and the admin CLI, so all three say the same thing.
The decision (`judge`) is a pure function of what the probe saw; the probe is thin.
"""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import struct
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from fedgpu.core.tls import TlsFiles

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# An empty SETTINGS frame: a gRPC (HTTP/2) server answers with its own SETTINGS.
H2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
H2_FRAME_SETTINGS = 4
# The bulk port's greeting with a ticket no one issued (fedgpu.core.bulk): it answers with a
# status frame that refuses it.
BULK_HELLO = b"FGB1" + struct.pack(">H", 1) + b"?"
# OpenSSL's verify codes (x509_vfy.h) that say which check failed.
_NOT_YET_VALID, _EXPIRED = 9, 10
_WRONG_CA = {2, 18, 19, 20, 21}
_NAME_MISMATCH = {62, 64}


class Cause(StrEnum):
    NAME_MISMATCH = "name-mismatch"
    EXPIRED = "expired"
    NOT_YET_VALID = "not-yet-valid"
    WRONG_CA = "wrong-ca"
    CLIENT_CERT_REQUIRED = "client-certificate-required"
    CLIENT_CERT_REFUSED = "client-certificate-refused"
    OWN_CERT_EXPIRED = "own-certificate-expired"
    SERVER_SPEAKS_TLS = "server-speaks-tls"
    SERVER_PLAINTEXT = "server-plaintext"
    BULK_PORT = "bulk-port"
    HTTP_SERVER = "http-server"
    NOT_GRPC = "not-grpc"
    HANDSHAKE_FAILED = "handshake-failed"


@dataclass(frozen=True)
class Diagnosis:
    cause: Cause
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class CertFacts:
    """What a certificate says that a diagnosis needs."""

    names: tuple[str, ...]
    not_before: dt.datetime
    not_after: dt.datetime
    issuer: str


@dataclass
class Seen:
    """What the probe saw at the address (None: not tried or nothing)."""

    tls: bool = False                  # a TLS server answered our ClientHello
    alpn: str | None = None            # the protocol it chose ("h2" for gRPC)
    cert: CertFacts | None = None      # what it presented
    verify_code: int | None = None     # OpenSSL's code when verified as gRPC would
    verify_message: str = ""
    closed_after_handshake: bool = False  # it hung up on us right after (client cert)
    alert: str = ""                    # a TLS alert it sent, lower case
    plaintext: str | None = None       # "grpc" | "http" | "bulk" | "other" without TLS
    inside_tls: str | None = None      # the same, inside TLS that is not h2
    own_cert: CertFacts | None = None
    now: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))


def cert_facts(pem_or_der: bytes) -> CertFacts:
    from cryptography import x509

    cert = (x509.load_pem_x509_certificate(pem_or_der) if pem_or_der.startswith(b"-----")
            else x509.load_der_x509_certificate(pem_or_der))
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = tuple([*san.get_values_for_type(x509.DNSName),
                       *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))])
    except x509.ExtensionNotFound:
        names = ()
    return CertFacts(names, cert.not_valid_before_utc, cert.not_valid_after_utc,
                     cert.issuer.rfc4514_string())


def _day(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M UTC")


def judge(address: str, tls: TlsFiles | None, seen: Seen) -> Diagnosis | None:
    """The one-line diagnosis of what `seen` shows; None when nothing is wrong that we can
    name (the connection works, or nothing answers at all: an ordinary outage)."""
    host, port = split(address)
    own = seen.own_cert
    if tls is not None and own is not None and tls.cert is not None:
        if seen.now > own.not_after:
            return Diagnosis(Cause.OWN_CERT_EXPIRED, (
                f"our client certificate {tls.cert} expired on {_day(own.not_after)}: issue a "
                "new one with 'fedgpu certs node NAME' (or 'certs operator NAME') --force from "
                "the CA's directory"))
    if not seen.tls:
        if tls is None:
            return _what_answers(address, port, seen.plaintext)
        if seen.plaintext == "grpc":
            return Diagnosis(Cause.SERVER_PLAINTEXT, (
                f"the aggregator at {address} serves plaintext gRPC and we speak TLS: drop "
                "--tls-ca/--tls-cert/--tls-key (or use a connection without them), or start the "
                "aggregator with --tls-cert/--tls-key"))
        return _what_answers(address, port, seen.plaintext)
    if seen.alpn != "h2":
        # TLS, but not gRPC's HTTP/2: the bulk port under TLS, or another TLS service.
        return _what_answers(address, port, seen.inside_tls or "other", under_tls=True)
    if tls is None:
        return Diagnosis(Cause.SERVER_SPEAKS_TLS, (
            f"the aggregator at {address} speaks TLS and we do not: pass --tls-ca with its CA "
            "(and --tls-cert/--tls-key if it requires client certificates), or use a saved "
            "connection that has them"))
    cert = seen.cert
    if cert is not None and seen.now > cert.not_after:
        return Diagnosis(Cause.EXPIRED, (
            f"the aggregator's certificate at {address} expired on {_day(cert.not_after)} "
            f"(now {_day(seen.now)}): re-issue it with 'fedgpu certs server --force' and restart "
            "the aggregator"))
    if cert is not None and seen.now < cert.not_before:
        return Diagnosis(Cause.NOT_YET_VALID, (
            f"the aggregator's certificate at {address} is valid only from "
            f"{_day(cert.not_before)} (now {_day(seen.now)} here): check this machine's clock "
            "(and the aggregator's), or re-issue the certificate"))
    code = seen.verify_code
    if code in _WRONG_CA:
        ca = f"--tls-ca {tls.ca}" if tls.ca is not None else "the system's trusted CAs"
        issuer = f" (issued by {cert.issuer})" if cert is not None else ""
        return Diagnosis(Cause.WRONG_CA, (
            f"the aggregator's certificate at {address}{issuer} is not signed by {ca}: use the "
            "ca.crt from the directory its certificate was made in ('fedgpu certs server "
            "--dir DIR' writes DIR/ca.crt)"))
    if code in _NAME_MISMATCH:
        names = ", ".join(cert.names) if cert is not None and cert.names else "no names"
        return Diagnosis(Cause.NAME_MISMATCH, (
            f"the aggregator's certificate names {names} - not {host}: connect to one of those "
            f"or re-issue with --san {host} ('fedgpu certs server --san {host} --force')"))
    if code is not None:
        return Diagnosis(Cause.HANDSHAKE_FAILED, (
            f"the aggregator's certificate at {address} is not accepted: "
            f"{seen.verify_message or code}"))
    if seen.closed_after_handshake or "certificate" in seen.alert:
        if tls.cert is None:
            return Diagnosis(Cause.CLIENT_CERT_REQUIRED, (
                f"the aggregator at {address} requires a client certificate (mutual TLS): pass "
                "--tls-cert/--tls-key from 'fedgpu certs node NAME' (a node) or 'fedgpu certs "
                "operator NAME' (admin commands)"))
        return Diagnosis(Cause.CLIENT_CERT_REFUSED, (
            f"the aggregator at {address} refused our client certificate {tls.cert}: it must "
            "be issued by the aggregator's CA ('fedgpu certs node NAME' with the same --dir "
            "as its 'certs server')"))
    if seen.alert:
        return Diagnosis(Cause.HANDSHAKE_FAILED,
                         f"TLS handshake with {address} failed: {seen.alert}")
    return None


def _what_answers(address: str, port: int, what: str | None,
                  under_tls: bool = False) -> Diagnosis | None:
    if what == "bulk":
        return Diagnosis(Cause.BULK_PORT, (
            f"{address} is the aggregator's bulk data port, not its gRPC port: use its --port "
            f"(by default the bulk port is the gRPC port + 1: try {port - 1})"))
    if what == "http":
        return Diagnosis(Cause.HTTP_SERVER, (
            f"an HTTP server answers at {address} (the aggregator's dashboard or metrics port?), "
            "not the aggregator's gRPC port: use the port 'fedgpu server start --port' was given "
            "(default 50051)"))
    if what == "other" or (under_tls and what is None):
        kind = "a TLS service that is not gRPC" if under_tls else "something that is not gRPC"
        return Diagnosis(Cause.NOT_GRPC, (
            f"{kind} answers at {address}: is it the aggregator's gRPC port? (its --port, "
            "default 50051)"))
    return None


# ---- the probe -----------------------------------------------------------------------------


def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def probe(address: str, tls: TlsFiles | None, timeout: float = 3.0) -> Seen | None:
    """What answers at `address`; None when nothing does (no TCP connection)."""
    try:
        host, port = split(address)
        socket.create_connection((host, port), timeout=timeout).close()
    except (OSError, ValueError):
        return None
    seen = Seen()
    if tls is not None and tls.cert is not None:
        try:
            seen.own_cert = cert_facts(Path(tls.cert).read_bytes())
        except (OSError, ValueError):
            pass
    _handshake(host, port, tls, timeout, seen)
    if not seen.tls:
        seen.plaintext = _identify(host, port, None, timeout)
    elif seen.alpn != "h2":
        seen.inside_tls = _identify(host, port, tls, timeout)
    elif tls is not None:
        _verify(host, port, tls, timeout, seen)
    return seen


def worth_probing(exc: BaseException) -> bool:
    """A failed call that a probe may explain: gRPC's UNAVAILABLE covers every TLS failure,
    a wrong port and a dead server alike, and a channel that never connects (TLS against a
    server that answers in plaintext) runs into the call's deadline instead."""
    import grpc

    return isinstance(exc, grpc.RpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def diagnose(address: str, tls: TlsFiles | None, timeout: float = 3.0) -> Diagnosis | None:
    """Why a connection to `address` with `tls` fails, with the fix; None when we cannot name
    a cause (it works, or nothing listens there)."""
    seen = probe(address, tls, timeout)
    return None if seen is None else judge(address, tls, seen)


def _client_context(tls: TlsFiles | None, verify: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(tls.ca) if tls and tls.ca else None)
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if tls is not None and tls.cert is not None and tls.key is not None:
        ctx.load_cert_chain(str(tls.cert), str(tls.key))
    ctx.set_alpn_protocols(["h2"])
    return ctx


def _handshake(host: str, port: int, tls: TlsFiles | None, timeout: float, seen: Seen) -> None:
    """Unverified: does a TLS server answer, what does it present, does it keep us?"""
    try:
        ctx = _client_context(tls, verify=False)
    except (OSError, ssl.SSLError):
        ctx = _client_context(None, verify=False)  # our own files fail: see the server anyway
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as conn:
            seen.tls = True
            seen.alpn = conn.selected_alpn_protocol()
            der = conn.getpeercert(binary_form=True)
            if der:
                seen.cert = cert_facts(der)
            if seen.alpn != "h2":
                return
            conn.sendall(H2_PREFACE + H2_SETTINGS)
            # TLS 1.3: a refused client certificate arrives after the handshake, as an alert
            # on our first read or as the connection closing.
            if not conn.recv(64):
                seen.closed_after_handshake = True
    except ssl.SSLError as exc:
        text = f"{exc.reason or ''} {exc}".lower()
        if "alert" in text:
            seen.tls = True
            seen.alert = (exc.reason or str(exc)).lower().replace("_", " ")
    except TimeoutError:
        pass  # a slow server is not a refusal: nothing to say
    except OSError:
        if seen.tls:
            seen.closed_after_handshake = True


def _verify(host: str, port: int, tls: TlsFiles, timeout: float, seen: Seen) -> None:
    """Verified as gRPC verifies: the chain against our CA, the name against the host."""
    try:
        ctx = _client_context(tls, verify=True)
    except (OSError, ssl.SSLError):
        return
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=host):
            pass
    except ssl.SSLCertVerificationError as exc:
        seen.verify_code = exc.verify_code
        seen.verify_message = exc.verify_message or ""
    except (ssl.SSLError, OSError):
        pass


def _identify(host: str, port: int, tls: TlsFiles | None, timeout: float) -> str:
    """Which kind of server this is: "grpc", "http", "bulk" or "other"."""
    first = _ask(host, port, tls, H2_PREFACE + H2_SETTINGS, timeout)
    if first.startswith(b"HTTP/"):
        return "http"
    if len(first) > 4 and first[4:5] == b"{":
        return "bulk"  # a status frame: u32 length, then JSON (it refused our preface)
    # An HTTP/2 server's first frame: its SETTINGS (type 4) on stream 0.
    if len(first) >= 9 and first[3] == H2_FRAME_SETTINGS and first[5:9] == b"\0\0\0\0":
        return "grpc"
    answer = _ask(host, port, tls, BULK_HELLO, timeout)
    if len(answer) > 4 and answer[4:5] == b"{":
        return "bulk"
    return "other"


def _ask(host: str, port: int, tls: TlsFiles | None, data: bytes, timeout: float) -> bytes:
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            if tls is None:
                raw.sendall(data)
                return raw.recv(64)
            ctx = _client_context(tls, verify=False)
            with ctx.wrap_socket(raw, server_hostname=host) as conn:
                conn.sendall(data)
                return conn.recv(64)
    except (OSError, ssl.SSLError):
        return b""
