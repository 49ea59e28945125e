"""`fedgpu users add|list|revoke`: the people who operate a federation and their roles
(admin, researcher, viewer), kept by the aggregator (server/people.py); admins only."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any

import typer

from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import new_table, print_json, print_table, when
from fedgpu.core import admin_client
from fedgpu.core.people import PersonRole, check_name, check_studies

Name = Annotated[str, typer.Argument(help="The person's name (their certificate's CN).")]


def _fingerprint(cert_pem: bytes) -> str:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    cert = x509.load_pem_x509_certificate(cert_pem)
    return hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()


def _cn(cert_pem: bytes) -> str:
    from fedgpu.core import certs

    return certs.identity(cert_pem)


@connection_options
def add(
    conn: Target,
    name: Name,
    role: Annotated[PersonRole, typer.Option(
        case_sensitive=False, help="admin: people and every job; researcher: submit, follow, "
        "stop and download the jobs of their studies; viewer: read only.")],
    study: Annotated[list[str] | None, typer.Option(
        "--study", help="A study the person works on (repeat). Researchers act on their "
        "studies' jobs only.")] = None,
    ca_dir: Annotated[Path | None, typer.Option(
        "--ca-dir", help="Issue the person a client certificate with this CA (a 'fedgpu certs "
        "init' directory) instead of a token: into CA_DIR/operators/NAME/, or from --csr.")
    ] = None,
    csr: Annotated[Path | None, typer.Option(
        "--csr", help="With --ca-dir: sign this certificate request (made by the person with "
        "'fedgpu certs request NAME --kind operator'): their key never leaves them.")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="With --csr: where to write the certificate (default NAME.crt).")
    ] = None,
    cert: Annotated[Path | None, typer.Option(
        "--cert", help="Pin a certificate already issued to them (by 'fedgpu certs sign "
        "--kind operator' at the CA): only it is accepted as them.")] = None,
    as_json: AsJson = False,
) -> None:
    """Add a person with a role. Without --ca-dir they get a token, printed once (give it to
    them: it is their --token and their dashboard login); with --ca-dir a certificate.

    Example: fedgpu users add alice --role researcher --study onco
    """
    check_name(name)
    studies = list(check_studies(study or []))
    from fedgpu.core.errors import ConfigError

    if csr is not None and ca_dir is None:
        raise ConfigError("--csr needs --ca-dir: the CA that signs it")
    if cert is not None and ca_dir is not None:
        raise ConfigError("--cert pins a certificate issued already; --ca-dir issues a new one: "
                          "give one of them")
    issued: list[Path] = []
    cert_sha256 = ""
    if cert is not None:
        try:
            cert_sha256 = _fingerprint(cert.read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the certificate {cert}: {exc}") from None
        issued_name = _cn(cert.read_bytes())
        if issued_name != name:
            raise ConfigError(f"{cert} is issued to {issued_name!r}, not {name!r}")
    elif ca_dir is not None:
        issued = _issue(name, ca_dir, csr, out)
        cert_sha256 = _fingerprint(issued[0].read_bytes())
    try:
        doc = admin_client.query(conn.address, conn.token, "AddUser", tls=conn.tls,
                                 name=name, role=str(role), studies=studies,
                                 cert_sha256=cert_sha256)
    except BaseException:
        for path in issued:  # the aggregator refused: no certificate of a non-person stays
            path.unlink(missing_ok=True)
        raise
    if as_json:
        print_json(doc)
        return
    user = doc["user"]
    typer.echo(f"added {user['name']} as {user['role']}"
               + (f" of {', '.join(user['studies'])}" if user["studies"] else ""))
    if doc.get("token"):
        typer.echo(f"token (shown once; their --token and dashboard login): {doc['token']}")
    else:
        typer.echo(f"certificate {issued[0] if issued else cert} (sha256 "
                   f"{cert_sha256[:16]}...)")


def _issue(name: str, ca_dir: Path, csr: Path | None, out: Path | None) -> list[Path]:
    """The person's certificate (first) and what else was written for them."""
    from fedgpu.core import certs

    if csr is not None:
        from fedgpu.core import csr as csrmod

        cert = csrmod.sign(csr, ca_dir, csrmod.Kind.OPERATOR, out or Path(f"{name}.crt"),
                           expect_name=name)
        return [cert]
    issued = certs.issue_operator(ca_dir, name)
    return [issued.cert, issued.key]


@connection_options
def list_users(conn: Target, as_json: AsJson = False) -> None:
    """The people of this federation: role, studies, credential, revoked or not.

    Example: fedgpu users list
    """
    doc = admin_client.query(conn.address, conn.token, "ListUsers", tls=conn.tls)
    if as_json:
        print_json(doc)
        return
    show_users(doc)


def show_users(doc: dict[str, Any]) -> None:
    users = doc.get("users") or []
    if not users:
        typer.echo("no users yet: 'fedgpu users add NAME --role R' adds one (the operator "
                   "credential acts as an admin)")
        return
    table = new_table("name", "role", "studies", "credential", "added", "revoked")
    for u in users:
        table.add_row(u["name"], u["role"], ", ".join(u["studies"]) or "-", u["credential"],
                      when(u.get("created_at"), short=True),
                      when(u["revoked_at"], short=True) if u.get("revoked_at") else "-")
    print_table(table)


@connection_options
def revoke(conn: Target, name: Name, as_json: AsJson = False) -> None:
    """Revoke a person: their token or certificate is refused from the next call on, also
    after a restart. Adding the name again issues new credentials.

    Example: fedgpu users revoke alice
    """
    doc = admin_client.query(conn.address, conn.token, "RevokeUser", tls=conn.tls, name=name)
    if as_json:
        print_json(doc)
        return
    typer.echo(f"revoked {doc['user']['name']}")
