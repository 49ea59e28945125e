"""`fedgpu doctor`: checks this host for a deployment, each with the fix."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from fedgpu.cli.common.connect import given_from, resolve
from fedgpu.cli.common.options import ConnectionName, TlsCa, TlsCert, TlsKey

_MARK = {"ok": "[green]ok[/green]  ", "warn": "[yellow]warn[/yellow]", "fail": "[red]FAIL[/red]"}


def doctor(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document, nothing else.")
                       ] = False,
    address: Annotated[str | None, typer.Option(
        "--address", help="Also check this aggregator (HOST:PORT) is reachable and healthy.")
    ] = None,
    token: Annotated[str | None, typer.Option(
        envvar="FEDGPU_TOKEN",
        help="With --address: also check the aggregator accepts this node token.")] = None,
    operator_token: Annotated[str | None, typer.Option(
        envvar="FEDGPU_OPERATOR_TOKEN",
        help="With --address: also ask the current job's state (operator hosts).")] = None,
    profile: Annotated[str | None, typer.Option(
        "--profile", help="The compose profile this host will run: cpu, gpu-offered, "
        "gpu-enforced or hetero. GPU checks fail for gpu-enforced/hetero, warn for "
        "gpu-offered (and without a profile), and are skipped for cpu.")] = None,
    tls_cert: TlsCert = None, tls_key: TlsKey = None, tls_ca: TlsCa = None,
    connection: ConnectionName = None,
) -> None:
    """Docker engine, Compose v2, NVIDIA runtime, NVML, driver vs torch's CUDA, GPUs,
    aggregator and TLS material: ok / warn / fail, each with what to fix. Exit 1 on a fail.

    Examples: fedgpu doctor --profile gpu-offered; fedgpu doctor --connection compose
    """
    from fedgpu.cli.doctor import checks as doc
    from fedgpu.core.tls import from_options

    doc.gpu_severity(profile)  # an unknown profile is a usage error before any probing
    tls = None
    if connection:
        # A saved connection gives the aggregator to check, its TLS files and the operator
        # token; the options on the command line still override them.
        target = resolve(given_from(
            ctx, {"token": "operator_token"}, connection=connection, address=address,
            token=operator_token, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
            insecure=False))
        address, operator_token, tls = target.address, target.token, target.tls
    else:
        tls = from_options(tls_cert, tls_key, tls_ca)
    checks = doc.run_checks(profile, address, token, tls, operator_token)
    result = doc.document(checks)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        from rich.console import Console
        from rich.markup import escape

        console = Console(highlight=False, soft_wrap=True)
        for c in checks:
            console.print(f"{_MARK[c.status]} {c.name:<15} {escape(c.detail)}")
            if c.fix and c.status != "ok":
                console.print(f"{'':21}fix: {escape(c.fix)}")
        fails = sum(c.status == "fail" for c in checks)
        warns = sum(c.status == "warn" for c in checks)
        console.print(f"{fails} failed, {warns} warning(s), "
                      f"{len(checks) - fails - warns} ok")
    raise typer.Exit(0 if result["ok"] else 1)
