"""`fedgpu ps`: the compose deployment's services, their health and GPU decisions."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from fedgpu.cli.deploy.options import ComposeFile, Profile, ProjectName, compose_project


def ps(
    profile: Profile = None, compose_file: ComposeFile = None, project_name: ProjectName = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """Each service: state, health, GPU reservation and the node's GPU decision.

    Example: fedgpu ps --profile hetero
    """
    from fedgpu.cli.deploy import compose as deploy

    project = compose_project(compose_file, project_name, profile)
    doc = deploy.ps(project, deploy.engine(), profile)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        print_ps(doc)


def print_ps(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    if not doc["services"]:
        typer.echo(f"project {doc['project']}: no containers (start with 'fedgpu up "
                   "--profile ...')")
        return
    table = Table("service", "state", "health", "gpu reservation", "gpu decision",
                  title=f"project {doc['project']}", title_justify="left")
    for s in doc["services"]:
        res = s["gpu_reservation"]
        reservation = "-" if res is None else (
            f"{res['driver'] or 'gpu'} " + (f"ids {','.join(res['device_ids'])}"
                                            if res["device_ids"] else f"count {res['count']}"))
        d = s["gpu_decision"]
        decision = "-" if d is None else (
            f"{d.get('device')}" + (f" {d.get('gpu_name')}" if d.get("gpu_name") else "")
            + f": {d.get('reason')}")
        if s["error"]:
            decision = f"exited {s['exit_code']}: {s['error']}"
        state = s["state"] + (f" ({s['exit_code']})" if s["exit_code"] is not None else "")
        table.add_row(s["service"], state, s["health"] or "-", reservation, decision)
    Console(soft_wrap=False).print(table)
