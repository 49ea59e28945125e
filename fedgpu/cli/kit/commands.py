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
Csr = Annotated[Path | None, typer.Option(
    "--csr", help="A certificate request the site or person made with 'fedgpu certs request "
    "NAME --out DIR' (its key stays there): the kit carries the certificate signed from it "
    "and no key. Unpack the kit into that DIR.")]
KeyPath = Annotated[str | None, typer.Option(
    "--key-path", help="With --csr: where the key is on the site's or person's machine, as "
    "the kit's config names it (default: beside the kit's files, as 'certs request' wrote "
    "it).")]


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
    policy: Annotated[Path | None, typer.Option(
        "--policy", show_default=False,
        help="The site's policy file (TOML: the studies, tasks and job terms it trains for; "
             "docs: how-to/site-policies.md), checked now and carried as policy.toml. The "
             "site may replace that file in its kit at any time.")] = None,
    csr_file: Csr = None,
    key_path: KeyPath = None,
    archive: Archive = False,
    days: Days = 825,
    force: Force = False,
) -> None:
    """Write a site's startup kit: its certificate and key (signed by the federation's CA),
    the CA certificate, and node.toml with the aggregator's address, the site's name and its
    TLS files. On the site's host, 'fedgpu node start --kit DIR' needs nothing else.

    With --policy the kit carries the site's policy file as policy.toml (node start uses it
    unless given --policy). The file is the site's: it may replace it in its kit at any time.

    With --csr (the site made its key and request with 'fedgpu certs request'), the kit holds
    the certificate signed from the request and no key: the key never leaves the site.

    Example: fedgpu kit site site-a --aggregator agg.example.org:50051 --data /srv/data
    """
    from fedgpu.core import certs

    address = _address(aggregator)
    if gpu is not None and gpu not in ("none", "offer", "enforce"):
        raise ConfigError(f"--gpu {gpu!r}: one of none, offer, enforce")
    _key_path_needs_csr(csr_file, key_path)
    policy_text = None if policy is None else _site_policy(policy)
    out = out or Path("kits") / name
    issued = None if csr_file else _certificate(ca_dir, name, certs.Role.NODE, days)
    with files.writing(out, force) as tmp:
        _certificate_files(tmp, issued, csr_file, ca_dir, name, certs.Role.NODE, days)
        files.write_text(tmp / files.NODE_CONFIG, files.node_toml(
            address, name, data, gpu, certs.NODE_CERT, key_path or certs.NODE_KEY,
            certs.CA_CERT, files.POLICY_FILE if policy_text is not None else None))
        if policy_text is not None:
            files.write_text(tmp / files.POLICY_FILE, policy_text)
    typer.echo(f"site {name}: kit in {out}; on its host: fedgpu node start --kit {out}"
               + ("" if data else " --data DIR"))
    if csr_file is not None:
        from fedgpu.core.csr import fingerprint

        typer.echo(f"request fingerprint sha256 {fingerprint(csr_file.read_bytes())}: check it "
                   "against the one the site read out")
        typer.echo(f"no key in the kit: put its files beside the site's {key_path or 'node.key'}"
                   f" (the directory 'fedgpu certs request' wrote), e.g. tar xzf {name}.tar.gz"
                   " where that directory is")
    if archive:
        typer.echo(f"archive: {files.archive(out, force)}")


def operator(
    name: Annotated[str, typer.Argument(help="Who operates (a person or a tool).")],
    aggregator: Aggregator,
    ca_dir: CaDir = Path("certs"),
    out: Out = None,
    csr_file: Csr = None,
    key_path: KeyPath = None,
    archive: Archive = False,
    days: Days = 825,
    force: Force = False,
) -> None:
    """Write a person's startup kit: an operator certificate and key, the CA certificate, and
    connections.toml, a saved connection NAME with paths inside the kit. Use it with
    FEDGPU_CONFIG_DIR=DIR and --connection NAME, or copy the files into your own.

    With --csr (the person made their key and request with 'fedgpu certs request NAME
    --kind operator'), the kit holds the certificate signed from it and no key.

    Example: fedgpu kit operator alice --aggregator agg.example.org:50051
    """
    from fedgpu.cli.common import connections
    from fedgpu.core import certs

    address = _address(aggregator)
    connections.check_name(name)
    _key_path_needs_csr(csr_file, key_path)
    out = out or Path("kits") / f"operator-{name}"
    issued = None if csr_file else _certificate(ca_dir, name, certs.Role.OPERATOR, days)
    saved = connections.SavedConnection(name, address, tls_ca=Path(certs.CA_CERT),
                                        tls_cert=Path(certs.OPERATOR_CERT),
                                        tls_key=Path(key_path or certs.OPERATOR_KEY))
    with files.writing(out, force) as tmp:
        _certificate_files(tmp, issued, csr_file, ca_dir, name, certs.Role.OPERATOR, days)
        files.write_text(tmp / files.CONNECTIONS,
                         connections.dumps(connections.Connections(name, {name: saved})))
    typer.echo(f"operator {name}: kit in {out}; FEDGPU_CONFIG_DIR={out} fedgpu status "
               f"--connection {name}")
    if archive:
        typer.echo(f"archive: {files.archive(out, force)}")


def _site_policy(path: Path) -> str:
    """The policy file's text, checked by the parser the node uses (a bad file is refused
    here with its error, before any kit is written); the kit carries this very text."""
    from fedgpu.core import site_policy

    try:
        with open(path, "rb") as fh:
            raw = fh.read(site_policy.MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"--policy {path}: cannot read it ({exc.strerror})") from None
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"--policy {path}: not UTF-8 text") from None
    site_policy.parse(text, f"--policy {path}")
    return text


def _key_path_needs_csr(csr_file: Path | None, key_path: str | None) -> None:
    if key_path is not None and csr_file is None:
        raise ConfigError("--key-path names the key a site or person made with 'fedgpu certs "
                          "request': pass their request with --csr")


def _certificate_files(tmp: Path, issued: Issued | None, csr_file: Path | None, ca_dir: Path,
                       name: str, role: Role, days: int) -> None:
    """The kit's certificate, key and CA certificate: copied from what `_certificate` issued,
    or, for a request (--csr), the certificate signed from it and no key at all."""
    from fedgpu.core import certs, csr

    cert_name, key_name = ((certs.NODE_CERT, certs.NODE_KEY) if role is certs.Role.NODE
                           else (certs.OPERATOR_CERT, certs.OPERATOR_KEY))
    if csr_file is not None:
        kind = csr.Kind.SITE if role is certs.Role.NODE else csr.Kind.OPERATOR
        csr.sign(csr_file, ca_dir, kind, tmp / cert_name, days, expect_name=name)
        return
    assert issued is not None
    files.copy_file(issued.cert, tmp / cert_name)
    files.copy_file(issued.key, tmp / key_name, private=True)
    files.copy_file(ca_dir / certs.CA_CERT, tmp / certs.CA_CERT)


def _certificate(ca_dir: Path, name: str, role: Role, days: int) -> Issued:
    """The certificate and key the kit carries: one already issued for `name` by this CA, else
    one issued now, its key made here (a kit made from a request, --csr, uses neither)."""
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
