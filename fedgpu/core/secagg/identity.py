"""Sites that sign what they say in secure aggregation, with the key of their TLS identity.

Against an aggregator that bends the protocol (Bonawitz et al. 2017, the active model), two
things must hold that an honest-but-curious aggregator gets for free:

- the public keys a site masks against are its neighbours', not keys the aggregator made
  (with those it could rebuild the pairwise masks itself) or keys of another round;
- every survivor was shown the same set of survivors before any share is revealed (the
  consistency check), so no two groups of shareholders can be told different stories.

Under mutual TLS every site holds a private key and a certificate the federation's CA signed
for its name, so each site signs (1) its two advertised keys with the round's context and its
index, and (2) the survivor set it was shown; its neighbours check the certificate against the
CA, its role (a node, not the aggregator or an operator) and the name the round's roster gives
that index, then the signature. The aggregator relays certificates and signatures it cannot
make. With tokens only there is no identity to sign with: the model is honest-but-curious
(docs/explanation/secure-aggregation.md).

The signature is the certificate key's own: ECDSA P-256 with SHA-256 for the keys
`fedgpu certs` issues, Ed25519 for an Ed25519 key.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

from fedgpu.core.certs import Role
from fedgpu.core.secagg.errors import SecAggError

KEYS_LABEL = b"fedgpu secagg advertised keys v1"
VIEW_LABEL = b"fedgpu secagg survivors v1"
# Wire bounds for what a site relays: a DER certificate and a DER (or raw) signature.
MAX_CERT_BYTES = 8192
MAX_SIGNATURE_BYTES = 256
MAX_NAME_BYTES = 255


def keys_statement(context: bytes, index: int, c_public: bytes, s_public: bytes) -> bytes:
    """What a site signs when it advertises its keys: bound to this round (the context is
    fresh per attempt, so a key relayed from another round does not verify) and its index."""
    return KEYS_LABEL + context + index.to_bytes(4, "big") + c_public + s_public


def view_statement(context: bytes, survivors: tuple[int, ...]) -> bytes:
    """What a site signs in the consistency check: the survivors it was shown, sorted."""
    return (VIEW_LABEL + context + len(survivors).to_bytes(4, "big")
            + b"".join(i.to_bytes(4, "big") for i in sorted(survivors)))


def _sign(key: object, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    raise SecAggError("a site's TLS key must be ECDSA or Ed25519 to sign secure-aggregation "
                      "messages")


def verify(cert: x509.Certificate, signature: bytes, data: bytes) -> bool:
    """True when `signature` over `data` was made with the key `cert` certifies."""
    key = cert.public_key()
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        else:
            return False
    except InvalidSignature:
        return False
    return True


def _name(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""


def _roles(cert: x509.Certificate) -> set[str]:
    return {str(a.value) for a in
            cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)}


@dataclass(frozen=True)
class SiteIdentity:
    """This site's TLS identity: its name, its certificate (DER, sent to its neighbours),
    its private key (signs), and the federation's CA (checks the neighbours')."""

    name: str
    cert_der: bytes
    ca: x509.Certificate = field(repr=False)
    _key: object = field(repr=False)

    @classmethod
    def from_files(cls, cert: Path, key: Path, ca: Path) -> SiteIdentity:
        """From the node's --tls-cert, --tls-key and --tls-ca (PEM)."""
        c = x509.load_pem_x509_certificate(cert.read_bytes())
        k = serialization.load_pem_private_key(key.read_bytes(), password=None)
        authority = x509.load_pem_x509_certificate(ca.read_bytes())
        ident = cls(_name(c), c.public_bytes(serialization.Encoding.DER), authority, k)
        # The key must be the certificate's: a mismatch would fail at every neighbour.
        if not verify(c, ident.sign(b"check"), b"check"):
            raise SecAggError(f"{key} is not the private key of {cert}")
        return ident

    def sign(self, data: bytes) -> bytes:
        return _sign(self._key, data)

    def check_peer(self, cert_der: bytes, name: str, now: dt.datetime | None = None
                   ) -> x509.Certificate:
        """A neighbour's certificate, checked: issued by the federation's CA, in date, for a
        node (not the aggregator's or an operator's) and for `name`, the site the round's
        roster puts at its index. SecAggError says which check failed."""
        if not cert_der or len(cert_der) > MAX_CERT_BYTES:
            raise SecAggError(f"no certificate (or an oversized one) for site {name!r}")
        try:
            cert = x509.load_der_x509_certificate(cert_der)
            cert.verify_directly_issued_by(self.ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise SecAggError(f"the certificate for site {name!r} was not issued by this "
                              f"federation's CA ({exc or type(exc).__name__})") from None
        when = now or dt.datetime.now(dt.UTC)
        if not cert.not_valid_before_utc <= when <= cert.not_valid_after_utc:
            raise SecAggError(f"the certificate for site {name!r} is not valid now")
        roles = _roles(cert)
        if roles & {Role.AGGREGATOR.value, Role.OPERATOR.value}:
            raise SecAggError(f"the certificate for site {name!r} is not a node's "
                              f"({', '.join(sorted(roles))})")
        if _name(cert) != name:
            raise SecAggError(f"the certificate at the index of site {name!r} is "
                              f"{_name(cert)!r}'s")
        return cert
