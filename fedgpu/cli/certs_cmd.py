"""`fedgpu certs init|server|node|operator|k8s-secrets`: TLS material for a deployment
(fedgpu.core.certs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

certs_app = typer.Typer(help="TLS material: a CA, the aggregator's and each node's certs.",
                        no_args_is_help=True)
Dir = Annotated[Path, typer.Option("--dir", help="Directory holding the CA and issued certs.")]
Force = Annotated[bool, typer.Option("--force", help="Replace existing files.")]
Days = Annotated[int, typer.Option(help="Validity in days.")]


@certs_app.command("init")
def init(directory: Dir = Path("certs"), days: Days = 3650, force: Force = False,
         name: Annotated[str, typer.Option(help="The CA's common name.")] = "fedgpu CA") -> None:
    """Make the CA (ca.crt, ca.key). Keep ca.key off the servers."""
    from fedgpu.core import certs

    path = certs.init_ca(directory, name, days, force)
    typer.echo(f"CA certificate {path}; key {directory / certs.CA_KEY} (keep it offline)")


@certs_app.command("server")
def server(
    directory: Dir = Path("certs"),
    san: Annotated[list[str] | None, typer.Option(
        "--san", help="Host name or IP nodes dial (repeat); default localhost, 127.0.0.1, "
                      "aggregator.")] = None,
    name: Annotated[str, typer.Option(help="Common name.")] = "aggregator",
    days: Days = 825,
    force: Force = False,
) -> None:
    """Issue the aggregator's certificate into DIR/server/ (with a copy of ca.crt)."""
    from fedgpu.core import certs

    issued = certs.issue_server(directory, name, san or None, days, force)
    typer.echo(f"aggregator: --tls-cert {issued.cert} --tls-key {issued.key} "
               f"--tls-ca {issued.ca}")


@certs_app.command("node")
def node(
    name: Annotated[str, typer.Argument(help="The node's name; it must register under it.")],
    directory: Dir = Path("certs"),
    days: Days = 825,
    force: Force = False,
) -> None:
    """Issue a node's client certificate into DIR/nodes/NAME/."""
    from fedgpu.core import certs

    issued = certs.issue_node(directory, name, days, force)
    typer.echo(f"{name}: --tls-cert {issued.cert} --tls-key {issued.key} --tls-ca {issued.ca}")


@certs_app.command("operator")
def operator(
    name: Annotated[str, typer.Argument(help="Who operates (a person or a tool).")] = "operator",
    directory: Dir = Path("certs"),
    days: Days = 825,
    force: Force = False,
) -> None:
    """Issue an operator's client certificate into DIR/operators/NAME/: it may submit, stop
    and read jobs and the federation, and may not register as a node."""
    from fedgpu.core import certs

    issued = certs.issue_operator(directory, name, days, force)
    typer.echo(f"operator {name}: --tls-cert {issued.cert} --tls-key {issued.key} "
               f"--tls-ca {issued.ca}")


@certs_app.command("k8s-secrets")
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
    that pod's key pair and ca.crt (never ca.key)."""
    from fedgpu.core import certs

    manifests = certs.secret_manifests(directory, namespace, nodes, aggregator, token,
                                       operator_token)
    if out is None:
        typer.echo(json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests},
                              indent=2))
        return
    for path in certs.write_manifests(manifests, out, force):
        typer.echo(str(path))


def register(app: typer.Typer) -> None:
    app.add_typer(certs_app, name="certs")
