"""Options of the compose deployment commands (`fedgpu up|down|ps|logs`), and how they find
the compose project."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

Profile = Annotated[str | None, typer.Option(
    "--profile", envvar="FEDGPU_PROFILE",
    help="cpu, gpu-offered, gpu-enforced, hetero or ring; none: the aggregator alone (nodes on "
         "other hosts dial it).")]
ComposeFile = Annotated[Path | None, typer.Option(
    "--compose-file", envvar="FEDGPU_COMPOSE_FILE",
    help="Default: compose/compose.yaml of this checkout.")]
ProjectName = Annotated[str | None, typer.Option(
    "--project-name", "-p", help="Compose project (default: COMPOSE_PROJECT_NAME, else the "
    "file's name:, 'fedgpu').")]


def compose_project(compose_file: Path | None, name: str | None, profile: str | None) -> Any:
    from fedgpu.cli.deploy import compose as deploy

    deploy.check_profile(profile)
    path = deploy.find_compose_file(compose_file)
    deploy.check_compose()
    return deploy.Project(path, deploy.project_name(path, name))
