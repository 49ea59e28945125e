"""`fedgpu up`: start the compose deployment (compose/compose.yaml) and wait until the
aggregator is healthy."""

from __future__ import annotations

import os
import time
from typing import Annotated, Any

import typer

from fedgpu.cli.deploy.options import ComposeFile, Profile, ProjectName, compose_project
from fedgpu.cli.deploy.ps import print_ps
from fedgpu.core.errors import FedgpuError


def up(
    profile: Profile = None, compose_file: ComposeFile = None, project_name: ProjectName = None,
    wait_s: Annotated[float, typer.Option(
        "--wait-s", help="Seconds to wait for the aggregator to be healthy; 0: don't wait.")
    ] = 180.0,
    skip_gpu_check: Annotated[bool, typer.Option(
        "--skip-gpu-check", help="Start GPU profiles even if this host shows no NVIDIA "
        "Container Toolkit (e.g. a remote engine).")] = False,
    save: Annotated[bool, typer.Option(
        "--save-connection/--no-save-connection", help="Save the aggregator as the default "
        "connection 'compose' ('fedgpu connection list').")] = True,
) -> None:
    """Start the aggregator and the profile's nodes (detached), then show them.

    Example: fedgpu up --profile cpu
    """
    from fedgpu.cli.deploy import compose as deploy

    project = compose_project(compose_file, project_name, profile)
    client = deploy.engine()
    if not skip_gpu_check:
        problem = deploy.gpu_host_problem(client, profile)
        if problem:
            raise FedgpuError(f"profile {profile} reserves NVIDIA GPUs, but {problem}; install "
                              "the NVIDIA Container Toolkit, use --profile cpu, or pass "
                              "--skip-gpu-check")
    missing = deploy.missing_images(client, project.images(profile))
    if missing:
        raise FedgpuError(f"image(s) {', '.join(missing)} not in the engine: build them with "
                          "'make images' (offline: 'make images OFFLINE=1'), or set "
                          "FEDGPU_SERVER_IMAGE/FEDGPU_NODE_IMAGE to ones you have")
    # The certs service gives the operator's key pair to this user (compose.yaml).
    os.environ.update(deploy.operator_owner_env())
    project.compose("up", "-d", "--no-build", "--remove-orphans",
                    profiles=[profile] if profile else [])
    if wait_s > 0:
        _wait_healthy(project, client, wait_s)
    print_ps(deploy.ps(project, client, profile))
    if save:
        try:
            typer.echo(deploy.save_connection(project), err=True)
        except FedgpuError as exc:  # the deployment is up: a missing connection is no failure
            typer.echo(f"warning: connection 'compose' not saved: {exc}", err=True)


def _wait_healthy(project: Any, client: Any, wait_s: float) -> None:
    end = time.monotonic() + wait_s
    health = None
    while time.monotonic() < end:
        found = project.containers(client, ["aggregator"])
        if found:
            found[0].reload()
            state = found[0].attrs["State"]
            health = (state.get("Health") or {}).get("Status")
            if health == "healthy":
                return
            if state.get("Status") in ("exited", "dead") or health == "unhealthy":
                tail = found[0].logs(tail=3).decode(errors="replace").strip().splitlines()
                raise FedgpuError(f"the aggregator is {health or state.get('Status')}: "
                                  f"{tail[-1] if tail else 'no log'}; see 'fedgpu logs "
                                  "aggregator'")
        time.sleep(1.0)
    raise FedgpuError(f"the aggregator was not healthy after {wait_s:.0f}s (health: "
                      f"{health}); see 'fedgpu logs aggregator'")
