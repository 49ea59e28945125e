"""Keys made where they are used: a certificate request where the key lives, a certificate
where the CA lives.

`request` runs on the site (or the person's machine): it makes the private key (0600 from the
first byte) and a certificate signing request (CSR) naming the site or person. Only the CSR
travels to the CA. `sign` runs beside the CA key: it checks the request's signature (whoever
made it holds the key), and issues the certificate with the role the CA chose (`--kind`),
never the one the request asks for. The key never exists anywhere else, which
fedgpu.core.certs' one-stop commands (`fedgpu certs node`) cannot say: they make the key at
the CA and it must be carried to the site.

Threat model: a request is public (it holds a public key and a name); someone who swaps it in
transit gets a certificate for their own key under that name, so the CA compares the
request's fingerprint (`fingerprint`, printed by `request`) with the one the site reads out
over another channel, as SSH host keys are checked.
"""

from __future__ import annotations

import hashlib
import os
from enum import StrEnum
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedgpu.core import certs
from fedgpu.core.errors import ConfigError

# A CSR is a few hundred bytes; anything much larger is not one of ours.
MAX_CSR_BYTES = 64 << 10


class Kind(StrEnum):
    """What the certificate is for: a site's node agent, or a person operating."""

    SITE = "site"
    OPERATOR = "operator"


_ROLE = {Kind.SITE: certs.Role.NODE, Kind.OPERATOR: certs.Role.OPERATOR}
_KEY_FILE = {Kind.SITE: certs.NODE_KEY, Kind.OPERATOR: certs.OPERATOR_KEY}


def fingerprint(csr_pem: bytes) -> str:
    """sha256 of the request's DER: read it out to the CA, who checks it before signing."""
    req = x509.load_pem_x509_csr(csr_pem)
    return hashlib.sha256(req.public_bytes(serialization.Encoding.DER)).hexdigest()


def request(name: str, out: Path, kind: Kind = Kind.SITE,
            force: bool = False) -> tuple[Path, Path]:
    """Make a key (OUT/node.key or OUT/operator.key, mode 0600) and OUT/NAME.csr."""
    if not name or len(name) > 64 or "/" in name or name.startswith("."):
        raise ConfigError(f"name {name!r} must be 1-64 characters, no '/', not starting "
                          "with '.'")
    out.mkdir(parents=True, exist_ok=True)
    key_path, csr_path = out / _KEY_FILE[kind], out / f"{name}.csr"
    existing = [str(p) for p in (key_path, csr_path) if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)} already exist(s); pass --force to replace")
    key = ec.generate_private_key(ec.SECP256R1())
    req = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
           .sign(key, hashes.SHA256()))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    if key_path.exists():
        key_path.unlink()  # --force: a new file, created 0600, not an old one's mode
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    csr_path.write_bytes(req.public_bytes(serialization.Encoding.PEM))
    return key_path, csr_path


def load(csr_path: Path) -> x509.CertificateSigningRequest:
    try:
        data = csr_path.read_bytes()[:MAX_CSR_BYTES + 1]
    except OSError as exc:
        raise ConfigError(f"cannot read {csr_path}: {exc.strerror}") from None
    if len(data) > MAX_CSR_BYTES:
        raise ConfigError(f"{csr_path} is larger than a certificate request can be")
    if b"PRIVATE KEY" in data:
        raise ConfigError(f"{csr_path} holds a private key: send the CA the .csr only, and "
                          "keep the key where it was made")
    try:
        req = x509.load_pem_x509_csr(data)
    except ValueError:
        raise ConfigError(f"{csr_path} is not a PEM certificate request (make one with "
                          "'fedgpu certs request')") from None
    try:
        valid = req.is_signature_valid
    except (InvalidSignature, ValueError):
        valid = False
    if not valid:
        raise ConfigError(f"{csr_path}: the request's signature is invalid (damaged, or not "
                          "made by the holder of its key)")
    return req


def sign(csr_path: Path, ca_dir: Path, kind: Kind, out: Path, days: int = 825,
         expect_name: str | None = None, force: bool = False) -> Path:
    """Issue the certificate for the request at `csr_path` with the CA in `ca_dir`; the role
    comes from `kind`, the name from the request's CN (which must be `expect_name` if given).
    Writes OUT (and ca.crt beside it) and returns OUT."""
    req = load(csr_path)
    attrs = req.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = str(attrs[0].value) if attrs else ""
    if not name or len(name) > 64:
        raise ConfigError(f"{csr_path}: the request names no valid common name")
    if expect_name is not None and name != expect_name:
        raise ConfigError(f"{csr_path} is a request for {name!r}, not {expect_name!r}")
    public = req.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.key_size < 256:
        raise ConfigError(f"{csr_path}: the key must be ECDSA P-256 or stronger (as 'fedgpu "
                          "certs request' makes)")
    if out.exists() and not force:
        raise ConfigError(f"{out} already exists; pass --force to replace")
    ca_cert, ca_key = certs._load_ca(ca_dir)
    # The role is the CA's decision (`kind`); any OU the request asked for is ignored.
    cert = certs.leaf_certificate(ca_cert, ca_key, public, name, [], _ROLE[kind], days)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out.parent / certs.CA_CERT).write_bytes((ca_dir / certs.CA_CERT).read_bytes())
    return out
