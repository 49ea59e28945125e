"""`fedgpu certs request|sign`: keys made where they are used (fedgpu.core.csr). The site or
person runs `request` (key + CSR, the key stays); the CA runs `sign` on the CSR alone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedgpu.core.csr import Kind

KindOpt = Annotated[Kind, typer.Option(
    case_sensitive=False, help="site: a node agent's certificate; operator: a person's (their "
    "role is then set with 'fedgpu users add').")]
Force = Annotated[bool, typer.Option("--force", help="Replace existing files.")]


def request(
    name: Annotated[str, typer.Argument(help="The site's node name, or the person's name.")],
    out: Annotated[Path, typer.Option("--out", help="Directory for the key and NAME.csr.")],
    kind: KindOpt = Kind.SITE,
    force: Force = False,
) -> None:
    """Make a private key (mode 0600, it never leaves OUT) and a certificate request NAME.csr
    to send to the CA. Read the printed fingerprint out to the CA over another channel.

    Example: fedgpu certs request site-a --out /etc/fedgpu/tls
    """
    from fedgpu.core import csr

    key, req = csr.request(name, out, kind, force)
    typer.echo(f"key {key} (keep it here); request {req}: send it to the CA for 'fedgpu "
               f"certs sign {req.name} --kind {kind}'")
    typer.echo(f"request fingerprint sha256 {csr.fingerprint(req.read_bytes())}")


def sign(
    csr_file: Annotated[Path, typer.Argument(metavar="CSR", help="The request to sign.")],
    ca_dir: Annotated[Path, typer.Option("--ca-dir", help="The CA ('fedgpu certs init').")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the certificate (ca.crt "
                                      "is written beside it).")],
    kind: KindOpt = Kind.SITE,
    days: Annotated[int, typer.Option(help="Validity in days.")] = 825,
    force: Force = False,
) -> None:
    """Issue a certificate for a request, with the role --kind names (never the one the
    request asks for). Check the fingerprint printed here against the requester's first.

    Example: fedgpu certs sign site-a.csr --ca-dir certs --out site-a.crt
    """
    from fedgpu.core import csr

    cert = csr.sign(csr_file, ca_dir, kind, out, days, force=force)
    typer.echo(f"request fingerprint sha256 {csr.fingerprint(csr_file.read_bytes())}")
    typer.echo(f"certificate {cert} ({kind}); send it and {cert.parent / 'ca.crt'} back"
               + ("; then 'fedgpu users add NAME --role R --cert " + str(cert) + "'"
                  if kind is Kind.OPERATOR else ""))
