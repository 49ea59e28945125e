"""`fedgpu down`: stop and remove the compose deployment's containers."""

from __future__ import annotations

from typing import Annotated

import typer

from fedgpu.cli.deploy.options import ComposeFile, ProjectName, compose_project


def down(
    compose_file: ComposeFile = None, project_name: ProjectName = None,
    volumes: Annotated[bool, typer.Option(
        "--volumes", "-v", help="Also delete the volumes: checkpoints and node data.")
    ] = False,
) -> None:
    """Stop and remove every profile's containers (checkpoints kept unless --volumes).

    Example: fedgpu down
    """
    from fedgpu.cli.deploy import compose as deploy

    project = compose_project(compose_file, project_name, None)
    deploy.engine()
    project.compose("down", "--remove-orphans", *(["--volumes"] if volumes else []),
                    profiles=list(deploy.PROFILES))
    typer.echo(f"project {project.name} is down" + (" (volumes deleted)" if volumes else ""))
    retired = deploy.retire_connection()
    if retired:
        typer.echo(retired)
