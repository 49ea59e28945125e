"""`fedgpu node health`: the agent's status file, for container health checks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.node.options import STATUS_HELP
from fedgpu.core.constants import NODE_STATUS_FILE


def health(
    status_file: Annotated[Path, typer.Option(
        envvar="FEDGPU_NODE_STATUS", help=STATUS_HELP)] = Path(NODE_STATUS_FILE),
) -> None:
    """Exit 0 when the agent's status file is fresh (for container health checks).

    Example: fedgpu node health
    """
    from fedgpu.node.status import status_is_fresh

    ok, why = status_is_fresh(status_file)
    typer.echo(("healthy: " if ok else "unhealthy: ") + why, err=not ok)
    raise typer.Exit(0 if ok else 1)
