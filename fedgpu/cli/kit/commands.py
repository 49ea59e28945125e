"""`fedgpu kit site NAME` and `fedgpu kit operator NAME`: a startup kit per site and per person,
made where the federation's CA is (fedgpu/cli/kit/files.py says what a kit holds)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fedgpu.cli.kit import files
from fedgpu.core.errors import ConfigError

if TYPE_CHECKING:
    from fedgpu.core.certs import Issued, Role

CaDir = Annotated[Path, typer.Option(
    "--ca-dir", help="The federation's CA directory ('fedgpu certs init --dir DIR'); a site's "
    "or operator's certificate already issued there is reused, else one is issued.")]
Aggregator = Annotated[str, typer.Option(
    "--aggregator", help="The aggregator's HOST:PORT as the site or person reaches it (a name "
    "or address its certificate has: 'fedgpu certs server --san').")]
Out = Annotated[Path | None, typer.Option(
    "--out", help="The kit's directory (default: kits/NAME for a site, kits/operator-NAME for "
    "a person).")]
Archive = Annotated[bool, typer.Option(
    "--archive", help="Also write DIR.tar.gz, to hand over as one file.")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing kit.")]
Days = Annotated[int, typer.Option(help="Validity of a newly issued certificate, in days.")]


def _address(aggregator: str) -> str:
    if ":" not in aggregator:
        raise ConfigError(f"--aggregator {aggregator!r} must be HOST:PORT "
                          "(e.g. agg.example.org:50051)")
    return aggregator


def site(
    name: Annotated[str, typer.Argument(help="The site's node name; it registers under it.")],
    aggregator: Aggregator,
    ca_dir: CaDir = Path("certs"),
    out: Out = None,
    data: Annotated[Path | None, typer.Option(
        "--data", help="The data directory on the site's host, written into node.toml "
        "(without it the site passes --data to 'node start').")] = None,
    gpu: Annotated[str | None, typer.Option(
        "--gpu", help="The site's GPU policy (none, offer, enforce) in node.toml.")] = None,
    archive: Archive = False,
    days: Days = 825,
    force: Force = False,
) -> None:
    """Write a site's startup kit: its certificate and key (signed by the federation's CA),
    the CA certificate, and node.toml with the aggregator's address, the site's name and its
    TLS files. On the site's host, 'fedgpu node start --kit DIR' needs nothing else.

    Example: fedgpu kit site site-a --aggregator agg.example.org:50051 --data /srv/data
    """
    from fedgpu.core import certs

    address = _address(aggregator)
    if gpu is not None and gpu not in ("none", "offer", "enforce"):
        raise ConfigError(f"--gpu {gpu!r}: one of none, offer, enforce")
    out = out or Path("kits") / name
    issued = _certificate(ca_dir, name, certs.Role.NODE, days)
    with files.writing(out, force) as tmp:
        files.copy_file(issued.cert, tmp / certs.NODE_CERT)
        files.copy_file(issued.key, tmp / certs.NODE_KEY, private=True)
        files.copy_file(ca_dir / certs.CA_CERT, tmp / certs.CA_CERT)
        files.write_text(tmp / files.NODE_CONFIG, files.node_toml(
            address, name, data, gpu, certs.NODE_CERT, certs.NODE_KEY, certs.CA_CERT))
    typer.echo(f"site {name}: kit in {out}; on its host: fedgpu node start --kit {out}"
               + ("" if data else " --data DIR"))
    if archive:
        typer.echo(f"archive: {files.archive(out, force)}")


def operator(
    name: Annotated[str, typer.Argument(help="Who operates (a person or a tool).")],
    aggregator: Aggregator,
    ca_dir: CaDir = Path("certs"),
    out: Out = None,
    archive: Archive = False,
    days: Days = 825,
    force: Force = False,
) -> None:
    """Write a person's startup kit: an operator certificate and key, the CA certificate, and
    connections.toml, a saved connection NAME with paths inside the kit. Use it with
    FEDGPU_CONFIG_DIR=DIR and --connection NAME, or copy the files into your own.

    Example: fedgpu kit operator alice --aggregator agg.example.org:50051
    """
    from fedgpu.cli.common import connections
    from fedgpu.core import certs

    address = _address(aggregator)
    connections.check_name(name)
    out = out or Path("kits") / f"operator-{name}"
    issued = _certificate(ca_dir, name, certs.Role.OPERATOR, days)
    saved = connections.SavedConnection(name, address, tls_ca=Path(certs.CA_CERT),
                                        tls_cert=Path(certs.OPERATOR_CERT),
                                        tls_key=Path(certs.OPERATOR_KEY))
    with files.writing(out, force) as tmp:
        files.copy_file(issued.cert, tmp / certs.OPERATOR_CERT)
        files.copy_file(issued.key, tmp / certs.OPERATOR_KEY, private=True)
        files.copy_file(ca_dir / certs.CA_CERT, tmp / certs.CA_CERT)
        files.write_text(tmp / files.CONNECTIONS,
                         connections.dumps(connections.Connections(name, {name: saved})))
    typer.echo(f"operator {name}: kit in {out}; FEDGPU_CONFIG_DIR={out} fedgpu status "
               f"--connection {name}")
    if archive:
        typer.echo(f"archive: {files.archive(out, force)}")


def _certificate(ca_dir: Path, name: str, role: Role, days: int) -> Issued:
    """The certificate and key the kit carries: one already issued for `name` by this CA, else
    one issued now, its key made here.

    Where the site made its own key and signing request (`fedgpu certs request`), the kit is to
    carry the signed certificate and no key: that is the one place to add it."""
    from fedgpu.core import certs

    if role is certs.Role.NODE:
        folder, cert_name, key_name = (ca_dir / certs.NODES_DIR / name, certs.NODE_CERT,
                                       certs.NODE_KEY)
        issue = certs.issue_node
    else:
        folder, cert_name, key_name = (ca_dir / certs.OPERATORS_DIR / name, certs.OPERATOR_CERT,
                                       certs.OPERATOR_KEY)
        issue = certs.issue_operator
    cert, key = folder / cert_name, folder / key_name
    if cert.is_file() and key.is_file():
        pem = cert.read_bytes()
        if certs.role(pem) != role or certs.identity(pem) != name:
            raise ConfigError(f"{cert} is not the {role} certificate of {name!r}: move it away "
                              "or pick another name")
        return certs.Issued(cert, key, ca_dir / certs.CA_CERT)
    return issue(ca_dir, name, days)
