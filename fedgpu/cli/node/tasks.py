"""`fedgpu node tasks`: the task bundles this site has seen or decided on."""

from __future__ import annotations

import json

import typer

from fedgpu.cli.common.ids import short
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import new_table, print_table, when
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
    # Hashes and job ids at 12 characters, as approve/reject take them: an 80-column table.
    table = new_table("sha256", "job", "state", "task", "size", "first seen", ids=2)
    for r in records:
        table.add_row(short(r.sha256), short(r.job), str(r.state), r.name or "?",
                      f"{r.size:,}" if r.size is not None else "-",
                      when(r.first_seen, short=True) if r.first_seen else "-")
    print_table(table)
    pending = [r for r in records if r.state == "pending"]
    if pending:
        typer.echo(f"review a pending bundle's sources (tar tvf {pending[0].archive}), then "
                   f"'fedgpu node approve {short(pending[0].sha256)}' (or 'fedgpu node "
                   f"reject ...')")
