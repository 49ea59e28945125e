"""`fedgpu certs init|server|node|operator|k8s-secrets`: TLS material for a deployment
(fedgpu.core.certs)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.common import connections
from fedgpu.cli.common.options import DEFAULT_ADDRESS
from fedgpu.core.errors import ConfigError

Dir = Annotated[Path, typer.Option("--dir", help="Directory holding the CA and issued certs.")]
Force = Annotated[bool, typer.Option("--force", help="Replace existing files.")]
Days = Annotated[int, typer.Option(help="Validity in days.")]


def init(directory: Dir = Path("certs"), days: Days = 3650, force: Force = False,
         name: Annotated[str, typer.Option(help="The CA's common name.")] = "fedgpu CA") -> None:
    """Make the CA (ca.crt, ca.key). Keep ca.key off the servers.

    Example: fedgpu certs init --dir certs
    """
    from fedgpu.core import certs

    path = certs.init_ca(directory, name, days, force)
    typer.echo(f"CA certificate {path}; key {directory / certs.CA_KEY} (keep it offline)")


def server(
    directory: Dir = Path("certs"),
    san: Annotated[list[str] | None, typer.Option(
        "--san", help="Another host name or IP nodes dial (repeat); added to localhost, "
                      "127.0.0.1 and aggregator, which stay unless --no-default-sans.")] = None,
    default_sans: Annotated[bool, typer.Option(
        "--default-sans/--no-default-sans",
        help="Keep localhost, 127.0.0.1 and aggregator among the names.")] = True,
    name: Annotated[str, typer.Option(help="Common name.")] = "aggregator",
    days: Days = 825,
    force: Force = False,
) -> None:
    """Issue the aggregator's certificate into DIR/server/ (with a copy of ca.crt). It names
    localhost, 127.0.0.1 and aggregator, and each --san.

    Example: fedgpu certs server --dir certs --san aggregator.example.org
    """
    from fedgpu.core import certs

    sans = certs.server_sans(san or [], default_sans)
    if not sans:
        raise ConfigError("--no-default-sans needs at least one --san: the names nodes dial")
    issued = certs.issue_server(directory, name, sans, days, force)
    typer.echo(f"aggregator: --tls-cert {issued.cert} --tls-key {issued.key} "
               f"--tls-ca {issued.ca}")
    typer.echo(f"it names {', '.join(dict.fromkeys([name, *sans]))}: nodes must dial one "
               "of those")


def node(
    name: Annotated[str, typer.Argument(help="The node's name; it must register under it.")],
    directory: Dir = Path("certs"),
    days: Days = 825,
    force: Force = False,
) -> None:
    """Issue a node's client certificate into DIR/nodes/NAME/.

    Example: fedgpu certs node site-a --dir certs
    """
    from fedgpu.core import certs

    issued = certs.issue_node(directory, name, days, force)
    typer.echo(f"{name}: --tls-cert {issued.cert} --tls-key {issued.key} --tls-ca {issued.ca}")


def operator(
    name: Annotated[str, typer.Argument(help="Who operates (a person or a tool).")] = "operator",
    directory: Dir = Path("certs"),
    days: Days = 825,
    force: Force = False,
    address: Annotated[str, typer.Option(
        "--address", help="The aggregator's HOST:PORT, for the saved connection.")
    ] = DEFAULT_ADDRESS,
    save: Annotated[bool, typer.Option(
        "--save/--no-save", help="Also save a connection (address, CA, this certificate) "
        "for the admin commands, under its name (--connection NAME).")] = True,
    save_as: Annotated[str | None, typer.Option(
        "--save-as", help="The saved connection's name (default: the operator's name).")
    ] = None,
    make_default: Annotated[bool, typer.Option(
        "--default", help="Also make the saved connection the default one (the commands "
        "then use it without --connection).")] = False,
) -> None:
    """Issue an operator's client certificate into DIR/operators/NAME/: it may submit, stop
    and read jobs and the federation, and may not register as a node. Saves a connection
    that uses it, so `fedgpu status --connection NAME` needs no TLS options; it never
    becomes the default connection unless --default says so.

    Example: fedgpu certs operator --dir certs --address aggregator.example.org:50051
    """
    from fedgpu.core import certs

    if save:
        connections.check_name(save_as or name)
        if ":" not in address:
            raise ConfigError(f"--address {address!r} must be HOST:PORT")
    issued = certs.issue_operator(directory, name, days, force)
    typer.echo(f"operator {name}: --tls-cert {issued.cert} --tls-key {issued.key} "
               f"--tls-ca {issued.ca}")
    if save:
        saved = connections.SavedConnection(
            save_as or name, address, tls_ca=issued.ca.resolve(),
            tls_cert=issued.cert.resolve(), tls_key=issued.key.resolve())
        with connections.editing() as box:
            replaced = saved.name in box[0].saved
            before = box[0].default
            box[0] = connections.put(box[0], saved, make_default=make_default)
            if not make_default:
                # Making a certificate never changes which aggregator the commands talk to.
                box[0] = dataclasses.replace(box[0], default=before)
            default = box[0].default == saved.name
        typer.echo(f"{'replaced' if replaced else 'saved'} connection {saved.name!r} "
                   f"({address}{', the default' if default else ''}) in "
                   f"{connections.file_path()}: fedgpu status --connection {saved.name}"
                   + ("" if default else f" (or 'fedgpu connection use {saved.name}' to "
                      "make it the default)"))


def k8s_secrets(
    directory: Dir = Path("certs"),
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write one Secret manifest per pod here (NAME.json, mode 0600) for "
                      "'kubectl apply -f OUT'; default: print one List to stdout, for "
                      "'| kubectl apply -f -'.")] = None,
    namespace: Annotated[str, typer.Option(
        "--namespace", "-n", help="Namespace of the Secrets (deploy/k8s uses fedgpu).")
    ] = "fedgpu",
    nodes: Annotated[list[str] | None, typer.Option(
        "--node", help="Only this node's Secret (repeat); default: every DIR/nodes/NAME.")
    ] = None,
    aggregator: Annotated[bool, typer.Option(
        "--aggregator/--no-aggregator", help="Include the aggregator's Secret.")] = True,
    token: Annotated[str | None, typer.Option(
        envvar="FEDGPU_TOKEN",
        help="Also write Secret fedgpu-token (the pods' FEDGPU_TOKEN, a second factor).")
    ] = None,
    operator_token: Annotated[str | None, typer.Option(
        envvar="FEDGPU_OPERATOR_TOKEN",
        help="Also write Secret fedgpu-operator-token (the aggregator's "
        "FEDGPU_OPERATOR_TOKEN: jobs, status, the dashboard).")] = None,
    force: Force = False,
) -> None:
    """Kubernetes Secrets for deploy/k8s: tls-aggregator and tls-NAME per node, each with only
    that pod's key pair and ca.crt (never ca.key).

    Example: fedgpu certs k8s-secrets --dir certs | kubectl apply -f -
    """
    from fedgpu.core import certs

    manifests = certs.secret_manifests(directory, namespace, nodes, aggregator, token,
                                       operator_token)
    if out is None:
        typer.echo(json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests},
                              indent=2))
        return
    for path in certs.write_manifests(manifests, out, force):
        typer.echo(str(path))
