"""TLS material for a deployment: a CA, the aggregator's certificate, one certificate per node.

Made with the `cryptography` library (no openssl binary needed on an operator's laptop or in a
container). Keys are ECDSA P-256: small, fast to make, and accepted by every gRPC TLS stack.

Layout under one directory, chosen so each container mounts exactly what it needs read-only
and the CA key never has to leave the operator's machine:

    ca.crt  ca.key                      the CA (keep ca.key offline)
    server/ca.crt server.crt server.key the aggregator's material
    nodes/<name>/ca.crt node.crt node.key   one directory per node
    operators/<name>/ca.crt operator.crt operator.key   one per operator (admin CLI, jobs)

Every certificate carries its role in the subject's organizational unit (OU), signed by the
CA like the rest of the subject: the aggregator gives a certificate the rights of its role
(fedgpu-node: register and train; fedgpu-operator: submit and stop jobs, read the federation),
never of its name alone, so a node named "operator" is still a node.

For Kubernetes the same material becomes one Secret per pod (`secret_manifests`): tls-aggregator
and tls-<name>, each holding only that pod's key pair and ca.crt, never ca.key. The names are
what deploy/k8s mounts.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import os
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedgpu.core.errors import ConfigError

CA_CERT, CA_KEY = "ca.crt", "ca.key"
SERVER_DIR, SERVER_CERT, SERVER_KEY = "server", "server.crt", "server.key"
NODES_DIR, NODE_CERT, NODE_KEY = "nodes", "node.crt", "node.key"
OPERATORS_DIR, OPERATOR_CERT, OPERATOR_KEY = "operators", "operator.crt", "operator.key"


class Role(StrEnum):
    """What a certificate may do, written into its subject's OU."""

    AGGREGATOR = "fedgpu-aggregator"
    NODE = "fedgpu-node"
    OPERATOR = "fedgpu-operator"
DEFAULT_SANS = ("localhost", "127.0.0.1", "aggregator")
# Kubernetes Secret names, as deploy/k8s mounts them (base/aggregator.yaml, node/node.yaml).
TLS_SECRET_PREFIX = "tls-"
AGGREGATOR_SECRET = TLS_SECRET_PREFIX + "aggregator"
TOKEN_SECRET, TOKEN_KEY = "fedgpu-token", "token"
OPERATOR_TOKEN_SECRET = "fedgpu-operator-token"
# A site's name is also its pod label value and part of object names: a DNS-1123 label.
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path
    ca: Path


def _now() -> dt.datetime:
    # Backdated a little: a node whose clock runs slightly behind still accepts a fresh cert.
    return dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    # Created 0600 from the start, so the key is never readable by others even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _refuse_overwrite(paths: list[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)} already exist(s); pass --force to replace")


def init_ca(directory: Path, common_name: str = "fedgpu CA", days: int = 3650,
            force: bool = False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    # Replacing a CA silently would orphan every certificate issued so far.
    _refuse_overwrite([cert_path, key_path], force)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    start = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    return cert_path


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if not (cert_path.exists() and key_path.exists()):
        raise ConfigError(f"no CA in {directory}: run 'fedgpu certs init --dir {directory}' first")
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{key_path} is not an EC key made by 'fedgpu certs init'")
    return cert, key


def _san(entry: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(entry))
    except ValueError:
        return x509.DNSName(entry)


def _issue(ca_dir: Path, out: Path, cert_name: str, key_name: str, common_name: str,
           sans: list[str], role: Role, days: int, force: bool) -> Issued:
    server = role is Role.AGGREGATOR
    if not common_name or len(common_name) > 64:
        raise ConfigError(f"name {common_name!r} must be 1-64 characters (X.509 CN limit)")
    ca_cert, ca_key = _load_ca(ca_dir)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path, ca_copy = out / cert_name, out / key_name, out / CA_CERT
    _refuse_overwrite([cert_path, key_path], force)
    key = ec.generate_private_key(ec.SECP256R1())
    # The aggregator's certificate may also act as a client: the server container's
    # HEALTHCHECK then presents it to its own mTLS port without needing a node's key.
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH]
                                                 if server else [])
    cert = leaf_certificate(ca_cert, ca_key, key.public_key(), common_name, sans, role,
                            days, usages)
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    ca_copy.write_bytes((ca_dir / CA_CERT).read_bytes())
    return Issued(cert_path, key_path, ca_copy)


def leaf_certificate(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                     public: ec.EllipticCurvePublicKey, common_name: str, sans: list[str],
                     role: Role, days: int,
                     usages: list[x509.ObjectIdentifier] | None = None) -> x509.Certificate:
    """A certificate the CA signs for `public`: CN and OU (the role, the CA's decision), the
    SANs, client use (and server use where asked). Keys made here and requests signed here
    (fedgpu/core/csr.py) get the same certificate."""
    usages = usages or [ExtendedKeyUsageOID.CLIENT_AUTH]
    names = list(dict.fromkeys([common_name, *sans]))
    start = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_encipherment=False, key_cert_sign=False,
            crl_sign=False, content_commitment=False, data_encipherment=False,
            key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        # gRPC checks the server's name against the SANs only (CN is ignored there), and the
        # aggregator reads a node's identity from CN and SANs alike.
        .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def server_sans(given: list[str], keep_defaults: bool = True) -> list[str]:
    """The names on the aggregator's certificate: the defaults (localhost, 127.0.0.1,
    aggregator) and those given, unless told to drop the defaults."""
    return list(dict.fromkeys([*(DEFAULT_SANS if keep_defaults else ()), *given]))


def issue_server(ca_dir: Path, name: str = "aggregator", sans: list[str] | None = None,
                 days: int = 825, force: bool = False) -> Issued:
    return _issue(ca_dir, ca_dir / SERVER_DIR, SERVER_CERT, SERVER_KEY, name,
                  list(sans if sans is not None else DEFAULT_SANS), Role.AGGREGATOR, days,
                  force)


def _check_name(name: str, what: str) -> None:
    if "/" in name or name.startswith("."):
        raise ConfigError(f"{what} name {name!r} may not contain '/' or start with '.'")


def issue_node(ca_dir: Path, name: str, days: int = 825, force: bool = False) -> Issued:
    _check_name(name, "node")
    return _issue(ca_dir, ca_dir / NODES_DIR / name, NODE_CERT, NODE_KEY, name, [], Role.NODE,
                  days, force)


def issue_operator(ca_dir: Path, name: str = "operator", days: int = 825,
                   force: bool = False) -> Issued:
    _check_name(name, "operator")
    return _issue(ca_dir, ca_dir / OPERATORS_DIR / name, OPERATOR_CERT, OPERATOR_KEY, name, [],
                  Role.OPERATOR, days, force)


def role(cert_pem: bytes) -> Role | None:
    """The role a certificate was issued for; None for one without a fedgpu role (made by
    another CA tool, or by fedgpu before roles existed): such a certificate is only a node."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    for attr in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME):
        try:
            return Role(str(attr.value))
        except ValueError:
            continue
    return None


def identity(cert_pem: bytes) -> str:
    """The name a certificate vouches for (its CN): a node's default --name."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""


def _secret(name: str, namespace: str, labels: dict[str, str],
            files: dict[str, bytes]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/name": "fedgpu",
                                "app.kubernetes.io/part-of": "fedgpu", **labels}},
        "type": "Opaque",
        "data": {key: base64.b64encode(value).decode("ascii") for key, value in files.items()},
    }


def _read_all(directory: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise ConfigError(f"{directory} lacks {', '.join(missing)}: issue it with 'fedgpu certs'")
    return {n: (directory / n).read_bytes() for n in names}


def secret_manifests(ca_dir: Path, namespace: str = "fedgpu", nodes: list[str] | None = None,
                     aggregator: bool = True, token: str | None = None,
                     operator_token: str | None = None) -> list[dict[str, Any]]:
    """Kubernetes Secrets from a `fedgpu certs` directory: one per pod's material.

    The aggregator's Secret holds server/{server.crt,server.key,ca.crt}; each node's (every
    directory under nodes/, or only `nodes`) its node.crt, node.key and ca.crt. ca.key is never
    read. With `token`, also the shared token Secret the pods read as FEDGPU_TOKEN; with
    `operator_token`, the aggregator's FEDGPU_OPERATOR_TOKEN (never mounted into a node).
    """
    if not _K8S_NAME.match(namespace):
        raise ConfigError(f"namespace {namespace!r} is not a valid Kubernetes name")
    out: list[dict[str, Any]] = []
    if aggregator:
        out.append(_secret(AGGREGATOR_SECRET, namespace,
                           {"app.kubernetes.io/component": "aggregator"},
                           _read_all(ca_dir / SERVER_DIR, (SERVER_CERT, SERVER_KEY, CA_CERT))))
    nodes_root = ca_dir / NODES_DIR
    available = sorted(p.name for p in nodes_root.iterdir() if p.is_dir()) \
        if nodes_root.is_dir() else []
    wanted = available if nodes is None else list(dict.fromkeys(nodes))
    unknown = [n for n in wanted if n not in available]
    if unknown:
        raise ConfigError(f"no certificate for {', '.join(unknown)} in {nodes_root}: issue it "
                          f"with 'fedgpu certs node NAME --dir {ca_dir}'")
    for name in wanted:
        if not _K8S_NAME.match(name):
            raise ConfigError(f"node {name!r} cannot be a Kubernetes site: a site's name must be "
                              f"lower-case letters, digits and '-', at most 63 characters")
        out.append(_secret(TLS_SECRET_PREFIX + name, namespace,
                           {"app.kubernetes.io/component": "node", "fedgpu.io/site": name},
                           _read_all(nodes_root / name, (NODE_CERT, NODE_KEY, CA_CERT))))
    for secret, value, what in ((TOKEN_SECRET, token, "token"),
                                (OPERATOR_TOKEN_SECRET, operator_token, "operator token")):
        if value is None:
            continue
        if not value:
            raise ConfigError(f"the {what} is empty")
        out.append(_secret(secret, namespace, {}, {TOKEN_KEY: value.encode()}))
    if token is not None and token == operator_token:
        raise ConfigError("the operator token must differ from the nodes' token")
    if not out:
        raise ConfigError(f"nothing to write: {ca_dir} has no aggregator or node certificates")
    return out


def write_manifests(manifests: list[dict[str, Any]], out: Path, force: bool = False) -> list[Path]:
    """One JSON file per Secret (`kubectl apply -f OUT`), created 0600: they hold keys."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{m['metadata']['name']}.json" for m in manifests]
    _refuse_overwrite(paths, force)
    for path, manifest in zip(paths, manifests, strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # also when --force replaces a file made with other modes
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(manifest, indent=2) + "\n")
    return paths
