"""Keys made where they are used (fedgpu.core.csr, `fedgpu certs request|sign`).

Threat model: the channel between a site and the CA, and the CA's machine, must never hold a
site's private key; a request swapped or damaged in transit must not be signed silently; the
role is the CA's choice, not the requester's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID
from typer.testing import CliRunner

from fedgpu.cli.app import app
from fedgpu.core import certs, csr
from fedgpu.core.errors import ConfigError


def _private_keys(root: Path) -> dict[Path, bytes]:
    """Every PEM private key file under `root`, by the public key it holds (DER)."""
    found = {}
    for path in root.rglob("*"):
        if path.is_file() and b"PRIVATE KEY" in path.read_bytes():
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            found[path] = key.public_key().public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return found


@pytest.mark.parametrize("kind", ["site", "operator"])
def test_the_private_key_exists_only_where_it_was_made(tmp_path: Path, kind: str) -> None:
    site, ca, transit = tmp_path / "site", tmp_path / "ca", tmp_path / "transit"
    runner = CliRunner()
    assert runner.invoke(app, ["certs", "init", "--dir", str(ca)]).exit_code == 0
    made = runner.invoke(app, ["certs", "request", "site-a", "--out", str(site), "--kind", kind])
    assert made.exit_code == 0, made.output
    # Only the request travels to the CA.
    transit.mkdir()
    (transit / "site-a.csr").write_bytes((site / "site-a.csr").read_bytes())
    signed = runner.invoke(app, ["certs", "sign", str(transit / "site-a.csr"), "--ca-dir",
                                 str(ca), "--kind", kind, "--out", str(transit / "site-a.crt")])
    assert signed.exit_code == 0, signed.output
    site_keys = _private_keys(site)
    assert len(site_keys) == 1
    (key_path, site_public), = site_keys.items()
    assert (key_path.stat().st_mode & 0o777) == 0o600
    assert _private_keys(transit) == {}
    # The CA's directory holds the CA's own key, and never the site's.
    assert site_public not in _private_keys(ca).values()
    cert = x509.load_pem_x509_certificate((transit / "site-a.crt").read_bytes())
    assert cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) == site_public
    assert certs.identity((transit / "site-a.crt").read_bytes()) == "site-a"
    want = certs.Role.NODE if kind == "site" else certs.Role.OPERATOR
    assert certs.role((transit / "site-a.crt").read_bytes()) is want


def test_the_ca_decides_the_role_not_the_request(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    certs.init_ca(tmp_path / "ca")
    key = ec.generate_private_key(ec.SECP256R1())
    req = (x509.CertificateSigningRequestBuilder().subject_name(x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, certs.Role.OPERATOR.value),
        x509.NameAttribute(NameOID.COMMON_NAME, "site-b")])).sign(key, hashes.SHA256()))
    path = tmp_path / "b.csr"
    path.write_bytes(req.public_bytes(serialization.Encoding.PEM))
    out = csr.sign(path, tmp_path / "ca", csr.Kind.SITE, tmp_path / "b.crt")
    assert certs.role(out.read_bytes()) is certs.Role.NODE


def test_bad_requests_are_refused_with_the_reason(tmp_path: Path) -> None:
    certs.init_ca(tmp_path / "ca")
    key, req = csr.request("site-c", tmp_path / "site")
    with pytest.raises(ConfigError, match="private key"):
        csr.sign(key, tmp_path / "ca", csr.Kind.SITE, tmp_path / "x.crt")
    damaged = tmp_path / "damaged.csr"
    pem = req.read_text().splitlines()
    body = "".join(pem[1:-1])
    # Flip a character near the end (inside the signature).
    flipped = body[:-10] + ("A" if body[-10] != "A" else "B") + body[-9:]
    damaged.write_text("\n".join([pem[0], *[flipped[i:i + 64] for i in
                                            range(0, len(flipped), 64)], pem[-1]]) + "\n")
    with pytest.raises(ConfigError, match="signature is invalid|not a PEM"):
        csr.sign(damaged, tmp_path / "ca", csr.Kind.SITE, tmp_path / "x.crt")
    with pytest.raises(ConfigError, match="not 'other'"):
        csr.sign(req, tmp_path / "ca", csr.Kind.SITE, tmp_path / "x.crt", expect_name="other")
    with pytest.raises(ConfigError, match="already exist"):
        csr.request("site-c", tmp_path / "site")
    assert not (tmp_path / "x.crt").exists()
