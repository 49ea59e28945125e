"""`fedgpu doctor`'s TLS checks: a certificate readable, in its validity period, issued by the
CA given, matching its key, and not about to expire. Pure: a file and the time in, a Check out."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from fedgpu.cli.doctor.result import FAIL, OK, WARN, Check

EXPIRY_WARN_DAYS = 30


def cert_check(label: str, path: Path, ca_path: Path | None, key_path: Path | None,
               now: dt.datetime | None = None) -> Check:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    name = f"tls_{label}"
    now = now or dt.datetime.now(dt.UTC)
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        return Check(name, FAIL, f"{path} is not a readable PEM certificate: {exc}",
                     "point --tls-cert/--tls-ca at the files 'fedgpu certs' wrote")
    subject = cert.subject.rfc4514_string()
    end = cert.not_valid_after_utc
    if cert.not_valid_before_utc > now:
        return Check(name, FAIL, f"{path} ({subject}) is not valid before "
                     f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC",
                     "check this host's clock (timedatectl)")
    if end <= now:
        return Check(name, FAIL, f"{path} ({subject}) expired on {end:%Y-%m-%d}",
                     "issue a new one with 'fedgpu certs ... --force'")
    if ca_path is not None and path != ca_path:
        try:
            ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
            cert.verify_directly_issued_by(ca)
        except (OSError, ValueError, TypeError) as exc:
            return Check(name, FAIL, f"{path} ({subject}) was not issued by {ca_path}: {exc}",
                         "use the certificate and CA from the same 'fedgpu certs' directory")
        except Exception as exc:  # cryptography's InvalidSignature carries no message
            return Check(name, FAIL, f"{path} ({subject}) was not signed by {ca_path} "
                         f"({type(exc).__name__})",
                         "use the certificate and CA from the same 'fedgpu certs' directory")
    if key_path is not None:
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            return Check(name, FAIL, f"{key_path} is not a readable unencrypted PEM key: {exc}",
                         "point --tls-key at the key 'fedgpu certs' wrote beside the cert")
        pub = serialization.PublicFormat.SubjectPublicKeyInfo
        enc = serialization.Encoding.DER
        if key.public_key().public_bytes(enc, pub) != cert.public_key().public_bytes(enc, pub):
            return Check(name, FAIL, f"{key_path} is not the key of {path}",
                         "use the key written beside the certificate")
    days = (end - now).total_seconds() / 86400
    detail = f"{path} ({subject}) valid until {end:%Y-%m-%d} ({days:.0f} days)"
    if days < EXPIRY_WARN_DAYS:
        return Check(name, WARN, f"{detail}: expires within {EXPIRY_WARN_DAYS} days",
                     "issue a new one with 'fedgpu certs ... --force' and roll it out")
    return Check(name, OK, detail)
