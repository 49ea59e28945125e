"""`fedgpu connection add|list|show|use|remove`: saved connections to aggregators
(fedgpu.cli.common.connections keeps them; fedgpu.cli.common.connect applies them)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.common import connections
from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import new_table, print_json, print_table
from fedgpu.cli.deploy.options import ComposeFile, ProjectName, compose_project
from fedgpu.core.errors import ConfigError
from fedgpu.core.tls import from_options

Name = Annotated[str, typer.Argument(help="The connection's name, e.g. prod or compose.")]


def add(
    name: Name,
    address: Annotated[str, typer.Option("--address", help="The aggregator's HOST:PORT.")],
    tls_ca: Annotated[Path | None, typer.Option(
        "--tls-ca", help="CA certificate (PEM) that signed the aggregator's certificate.")
    ] = None,
    tls_cert: Annotated[Path | None, typer.Option(
        "--tls-cert", help="The operator's client certificate (PEM), under mutual TLS "
        "('fedgpu certs operator').")] = None,
    tls_key: Annotated[Path | None, typer.Option(
        "--tls-key", help="Private key (PEM) for --tls-cert.")] = None,
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", help="A file holding the operator token (one line); read at each "
        "use.")] = None,
    token_stdin: Annotated[bool, typer.Option(
        "--token-stdin", help="Read the operator token from standard input and keep it in a "
        "0600 file beside the connections (not on the command line, where 'ps' shows it).")
    ] = False,
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="Plain gRPC, even where FEDGPU_TLS_* variables are set.")] = False,
    make_default: Annotated[bool, typer.Option(
        "--default", help="Make it the default connection (the first one saved is).")
    ] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace a saved connection of the same name.")] = False,
) -> None:
    """Save a connection: the aggregator's address, its CA and the operator's credential.

    Example: fedgpu connection add prod --address agg.example.org:50051 --tls-ca certs/ca.crt
    --tls-cert certs/operators/operator/operator.crt --tls-key
    certs/operators/operator/operator.key --token-stdin < token.txt
    """
    connections.check_name(name)
    if ":" not in address:
        raise ConfigError(f"--address {address!r} must be HOST:PORT (e.g. localhost:50051)")
    if token_file is not None and token_stdin:
        raise ConfigError("--token-file and --token-stdin: give one")
    if insecure and any((tls_ca, tls_cert, tls_key)):
        raise ConfigError("--insecure and --tls-ca/--tls-cert/--tls-key contradict each other")
    # The same checks a command runs before it connects: say now what would fail later.
    from_options(tls_cert, tls_key, tls_ca)
    if token_file is not None:
        connections.read_token(token_file)
    absolute = {k: p.expanduser().resolve() if p is not None else None
                for k, p in (("tls_ca", tls_ca), ("tls_cert", tls_cert), ("tls_key", tls_key),
                             ("token_file", token_file))}
    with connections.editing() as box:
        if name in box[0].saved and not force:
            raise ConfigError(f"a connection named {name!r} is saved already; pass --force to "
                              "replace it")
        if token_stdin:
            absolute["token_file"] = connections.save_token(name, sys.stdin.read(
                connections.MAX_TOKEN_BYTES + 1))
        saved = connections.SavedConnection(name, address, insecure=insecure, **absolute)
        box[0] = connections.put(box[0], saved, make_default)
        default = box[0].default
    typer.echo(f"saved connection {name!r} ({address})"
               + (", the default" if default == name else "")
               + f": fedgpu status --connection {name}")


def list_connections(as_json: AsJson = False) -> None:
    """The saved connections; the default one is marked with *.

    Example: fedgpu connection list
    """
    conns = connections.load()
    if as_json:
        print_json({"file": str(connections.file_path()), "default": conns.default,
                    "connections": [c.to_dict() for _, c in sorted(conns.saved.items())]})
        return
    if not conns.saved:
        typer.echo(f"no saved connections in {connections.file_path()}; 'fedgpu connection "
                   "add NAME --address HOST:PORT ...' saves one")
        return
    table = new_table("", "name", "address", "tls", "operator credential")
    for name, c in sorted(conns.saved.items()):
        tls = ("off" if c.insecure else "mutual" if c.tls_cert else "ca" if c.tls_ca
               else "-")
        cred = ", ".join(w for w, on in (("certificate", c.tls_cert), ("token", c.token_file))
                         if on) or "-"
        table.add_row("*" if name == conns.default else "", name, c.address, tls, cred)
    print_table(table)


@connection_options
def show(conn: Target, as_json: AsJson = False) -> None:
    """What a command given the same options would use: the address, the TLS files and
    whether a token is sent, and the saved connection they came from.

    Example: fedgpu connection show --connection compose
    """
    tls = conn.tls
    doc = {"connection": conn.connection, "address": conn.address,
           "tls_ca": str(tls.ca) if tls and tls.ca else None,
           "tls_cert": str(tls.cert) if tls and tls.cert else None,
           "tls_key": str(tls.key) if tls and tls.key else None,
           "token": conn.token is not None}
    if as_json:
        print_json(doc)
        return
    shown = {**doc, "token": "set" if conn.token is not None else "not set"}
    lines = [f"{k:<10} {v if v is not None else '-'}" for k, v in shown.items()]
    typer.echo("\n".join(lines))


def use(name: Name) -> None:
    """Make a saved connection the default: commands use it when given no address.

    Example: fedgpu connection use prod
    """
    with connections.editing() as box:
        box[0].get(connections.check_name(name), connections.file_path())
        box[0] = connections.Connections(name, box[0].saved)
    typer.echo(f"default connection: {name!r}")


def remove(name: Name) -> None:
    """Forget a saved connection (and the token file saved with it).

    Example: fedgpu connection remove prod
    """
    with connections.editing() as box:
        # An unknown name is refused here, with the saved names.
        box[0].get(connections.check_name(name), connections.file_path())
    connections.forget(name)
    typer.echo(f"removed connection {name!r}")


def save_compose(
    name: Annotated[str, typer.Option("--name", help="The connection's name.")] = "compose",
    compose_file: ComposeFile = None, project_name: ProjectName = None,
) -> None:
    """Save the compose deployment's aggregator (its published port, compose/certs' CA and
    operator certificate, its operator token) as a connection, made the default. `make up`
    and `fedgpu up` run this.

    Example: fedgpu connection save-compose
    """
    from fedgpu.cli.deploy import compose as deploy

    typer.echo(deploy.save_connection(compose_project(compose_file, project_name, None), name))
