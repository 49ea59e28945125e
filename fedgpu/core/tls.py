"""TLS settings shared by the aggregator, the nodes and the admin CLI.

Reads the PEM files once (a missing or unreadable file is a one-line ConfigError, not a gRPC
crash), builds gRPC credentials, and explains TLS failures that gRPC reports only as
"Socket closed" — from the client side a refused client certificate looks exactly like a dead
server, so we look at the handshake ourselves before telling the operator what is wrong.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from fedgpu.core.errors import ConfigError


@dataclass(frozen=True)
class TlsFiles:
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @property
    def enabled(self) -> bool:
        return any((self.cert, self.key, self.ca))

    @property
    def mutual(self) -> bool:
        return self.cert is not None and self.ca is not None


def from_options(cert: Path | None, key: Path | None, ca: Path | None) -> TlsFiles | None:
    if (cert is None) != (key is None):
        raise ConfigError("--tls-cert and --tls-key go together (FEDGPU_TLS_CERT/FEDGPU_TLS_KEY)")
    files = TlsFiles(cert, key, ca)
    for label, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
        if path is not None:
            _read(label, path)
    return files if files.enabled else None


def _read(label: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{label} {path} does not exist (make TLS material with "
                          "'fedgpu certs init|server|node')") from None
    except OSError as exc:
        raise ConfigError(f"{label} {path} is not readable: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{label} {path} is not a PEM file")
    return data


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    if tls.cert is None or tls.key is None:
        raise ConfigError("the aggregator needs --tls-cert and --tls-key to serve TLS")
    pair = (_read("--tls-key", tls.key), _read("--tls-cert", tls.cert))
    root = _read("--tls-ca", tls.ca) if tls.ca else None
    # With a client CA every connection must present a certificate it signed: the handshake
    # itself keeps strangers out, before any RPC (or token check) runs.
    return grpc.ssl_server_credentials([pair], root_certificates=root,
                                       require_client_auth=root is not None)


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read("--tls-ca", tls.ca) if tls.ca else None,
        private_key=_read("--tls-key", tls.key) if tls.key else None,
        certificate_chain=_read("--tls-cert", tls.cert) if tls.cert else None,
    )


def ssl_server_context(tls: TlsFiles) -> ssl.SSLContext:
    """The bulk port's TLS (fedgpu.core.bulk): the same certificate, key and client CA as the
    gRPC port, so mutual TLS there means mutual TLS here."""
    if tls.cert is None or tls.key is None:
        raise ConfigError("the aggregator needs --tls-cert and --tls-key to serve TLS")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    if tls.ca is not None:
        ctx.load_verify_locations(cafile=str(tls.ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def ssl_client_context(tls: TlsFiles) -> ssl.SSLContext:
    """A node's TLS to the bulk port: the aggregator's certificate checked against --tls-ca
    (the system's roots without one, as gRPC does), our certificate presented when we have
    one."""
    ctx = ssl.create_default_context(cafile=str(tls.ca) if tls.ca else None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert is not None and tls.key is not None:
        ctx.load_cert_chain(str(tls.cert), str(tls.key))
    return ctx


def looks_like_tls_failure(exc: grpc.RpcError) -> bool:
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and any(
        s in details for s in ("socket closed", "handshake", "ssl", "certificate", "tls"))


def diagnose(address: str, tls: TlsFiles | None, timeout: float = 3.0) -> str | None:
    """Why a TLS connection to `address` fails, in one line with the fix; None if it works,
    or if the aggregator cannot be reached at all (then it is an ordinary outage)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError):
        return None
    with raw:
        ctx = ssl.create_default_context()
        ctx.set_alpn_protocols(["h2"])
        if tls is None:
            # We speak plaintext; find out whether the other side wants TLS.
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        else:
            if tls.ca is not None:
                ctx.load_verify_locations(cafile=str(tls.ca))
            if tls.cert is not None and tls.key is not None:
                ctx.load_cert_chain(str(tls.cert), str(tls.key))
        try:
            with ctx.wrap_socket(raw, server_hostname=host) as conn:
                conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                answer = conn.recv(64)
        except ssl.SSLCertVerificationError as exc:
            return (f"the aggregator's certificate at {address} is not trusted "
                    f"({exc.verify_message}): pass --tls-ca with the CA that signed it, and "
                    "make sure its SANs include the host you dial ('fedgpu certs server --san')")
        except ssl.SSLError as exc:
            if tls is None:
                return None
            return f"TLS handshake with {address} failed: {exc.reason or exc}"
        except OSError:
            return None
    if tls is None:
        return (f"the aggregator at {address} speaks TLS and we do not: pass --tls-ca (and "
                "--tls-cert/--tls-key if it requires client certificates)")
    if answer:
        return None
    # Handshake done, then the server hung up without a word: it rejected our certificate.
    if tls.cert is None:
        return (f"the aggregator at {address} requires a client certificate (mutual TLS): "
                "pass --tls-cert/--tls-key from 'fedgpu certs node NAME'")
    return (f"the aggregator at {address} refused our client certificate {tls.cert}: it must "
            "be issued by the aggregator's CA ('fedgpu certs node NAME' with the same --dir)")
