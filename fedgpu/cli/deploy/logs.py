"""`fedgpu logs`: the compose deployment's container logs, interleaved."""

from __future__ import annotations

from typing import Annotated

import typer

from fedgpu.cli.deploy.options import ComposeFile, Profile, ProjectName, compose_project
from fedgpu.core.errors import ConfigError


def logs(
    services: Annotated[list[str] | None, typer.Argument(
        help="Services to show (default: all of the project's).")] = None,
    profile: Profile = None, compose_file: ComposeFile = None, project_name: ProjectName = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")
                      ] = False,
    tail: Annotated[str, typer.Option(help="Lines per container from the end, or 'all'.")
                    ] = "all",
) -> None:
    """The containers' logs, interleaved, each line prefixed with its service.

    Example: fedgpu logs aggregator --follow --tail 20
    """
    from fedgpu.cli.deploy import compose as deploy

    if tail != "all" and not tail.isdigit():
        raise ConfigError(f"--tail must be a number or 'all', not {tail!r}")
    if follow:
        from fedgpu.core.lifetime import restore_ctrl_c

        # --follow runs until Ctrl-C, even when started with SIGINT ignored (a script's `&`).
        restore_ctrl_c()
    project = compose_project(compose_file, project_name, profile)
    wanted = list(services) if services else (project.services(profile) if profile else None)
    deploy.logs(project, deploy.engine(), wanted, follow, int(tail) if tail.isdigit() else tail)
