"""`fedgpu node tasks`: the task bundles this site has seen or decided on."""

from __future__ import annotations

import json
import time

import typer
from rich.console import Console
from rich.table import Table

from fedgpu.cli.common.options import AsJson
from fedgpu.cli.node.approve import site_tasks
from fedgpu.cli.node.options import StateDirOpt


def tasks(state_dir: StateDirOpt = None, as_json: AsJson = False) -> None:
    """The task bundles this site has seen or decided on: pending, approved, rejected.

    Example: fedgpu node tasks
    """
    site = site_tasks(state_dir)
    records = site.records()
    if as_json:
        typer.echo(json.dumps([r.to_dict() for r in records], indent=2))
        return
    if not records:
        typer.echo(f"no task bundles at {site.root}")
        return
    table = Table("state", "task", "sha256", "size", "job", "first seen")
    for r in records:
        seen = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.first_seen))
                if r.first_seen else "-")
        table.add_row(str(r.state), r.name or "?", r.sha256,
                      f"{r.size:,}" if r.size is not None else "-", r.job or "-", seen)
    Console(width=200).print(table)
    pending = [r for r in records if r.state == "pending"]
    if pending:
        typer.echo(f"review a pending bundle's sources (tar tvf {pending[0].archive}), then "
                   f"'fedgpu node approve SHA256' (or 'fedgpu node reject SHA256')")
