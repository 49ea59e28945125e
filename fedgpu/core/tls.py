"""TLS settings shared by the aggregator, the nodes and the admin CLI.

Reads the PEM files once (a missing or unreadable file is a one-line ConfigError, not a gRPC
crash) and builds gRPC credentials and the bulk port's SSL contexts. Why a TLS connection
fails (gRPC says only "Socket closed") is fedgpu/core/tls_diagnosis.py's question.
"""

from __future__ import annotations

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
