"""`fedgpu node approve|reject`: a site's allow-list of task bundles (`fedgpu node tasks`
lists it).

They work on the node's state directory (`--state-dir`, FEDGPU_NODE_STATE), the one its agents
read; a running agent sees a decision at once (its next heartbeat tells the aggregator).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fedgpu.cli.common.options import AsJson
from fedgpu.cli.node.options import StateDirOpt

if TYPE_CHECKING:  # the node package is imported inside the commands only
    from fedgpu.node.approvals import SiteTasks

Target = Annotated[str, typer.Argument(
    help="The bundle's sha256 (or its first 8+ characters, as 'fedgpu node tasks' lists "
         "them), or a task directory: its hash is computed the way 'fedgpu task check' does.")]


def site_tasks(state_dir: Path | None) -> SiteTasks:
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


def approve(target: Target, state_dir: StateDirOpt = None, as_json: AsJson = False) -> None:
    """Put a task bundle on this site's allow-list (agents with --task-approval approved).

    Example: fedgpu node approve 3f2a9c1b
    """
    site = site_tasks(state_dir)
    sha, source = _target(site, target)
    site.approve(sha, source)
    _decided(site, sha, "approved", as_json)


def reject(target: Target, state_dir: StateDirOpt = None, as_json: AsJson = False) -> None:
    """Refuse a task bundle at this site (jobs that need it leave this node out).

    Example: fedgpu node reject 3f2a9c1b
    """
    site = site_tasks(state_dir)
    sha, source = _target(site, target)
    site.reject(sha, source)
    _decided(site, sha, "rejected", as_json)
