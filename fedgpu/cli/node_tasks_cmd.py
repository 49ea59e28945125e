"""`fedgpu node approve|reject|tasks`: a site's allow-list of task bundles.

They work on the node's state directory (`--state-dir`, FEDGPU_NODE_STATE), the one its agents
read; a running agent sees a decision at once (its next heartbeat tells the aggregator).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from fedgpu.cli.node_cmd import StateDirOpt, node_app
from fedgpu.cli.tls_options import AsJson

if TYPE_CHECKING:  # the node package is imported inside the commands only
    from fedgpu.node.approvals import SiteTasks

Target = Annotated[str, typer.Argument(
    help="The bundle's sha256 (or its first 8+ characters, as 'fedgpu node tasks' lists "
         "them), or a task directory: its hash is computed the way 'fedgpu task check' does.")]


def _site(state_dir: Path | None) -> SiteTasks:
    from fedgpu.node.approvals import SiteTasks, default_state_dir

    return SiteTasks(state_dir or default_state_dir())


def _target(site: SiteTasks, target: str) -> tuple[str, str]:
    """(sha256, where the decision came from); a directory is packed and its bundle cached, so
    the listing knows its name before any job brings it."""
    from fedgpu.core.bundles import pack_dir

    path = Path(target)
    if path.is_dir():
        bundle = pack_dir(path)
        site.keep(bundle, "")
        return bundle.sha256, f"directory {path.resolve()}"
    return site.resolve(target), "hash"


def _decided(site: SiteTasks, sha: str, verb: str, as_json: bool) -> None:
    record = site.record(sha)
    if as_json:
        typer.echo(json.dumps(record.to_dict(), indent=2))
        return
    what = f"task {record.name!r}" if record.name else "not seen yet"
    typer.echo(f"{verb} bundle {sha} ({what}) at {site.root}")


@node_app.command("approve")
def approve(target: Target, state_dir: StateDirOpt = None, as_json: AsJson = False) -> None:
    """Put a task bundle on this site's allow-list (agents with --task-approval approved)."""
    site = _site(state_dir)
    sha, source = _target(site, target)
    site.approve(sha, source)
    _decided(site, sha, "approved", as_json)


@node_app.command("reject")
def reject(target: Target, state_dir: StateDirOpt = None, as_json: AsJson = False) -> None:
    """Refuse a task bundle at this site (jobs that need it leave this node out)."""
    site = _site(state_dir)
    sha, source = _target(site, target)
    site.reject(sha, source)
    _decided(site, sha, "rejected", as_json)


@node_app.command("tasks")
def tasks(state_dir: StateDirOpt = None, as_json: AsJson = False) -> None:
    """The task bundles this site has seen or decided on: pending, approved, rejected."""
    site = _site(state_dir)
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
