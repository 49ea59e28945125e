"""`fedgpu up|down|ps|logs`: the compose deployment (compose/compose.yaml)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from fedgpu.core.errors import ConfigError, FedgpuError

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


def _project(compose_file: Path | None, name: str | None, profile: str | None) -> Any:
    from fedgpu.cli import deploy

    deploy.check_profile(profile)
    path = deploy.find_compose_file(compose_file)
    deploy.check_compose()
    return deploy.Project(path, deploy.project_name(path, name))


def up(
    profile: Profile = None, compose_file: ComposeFile = None, project_name: ProjectName = None,
    wait_s: Annotated[float, typer.Option(
        "--wait-s", help="Seconds to wait for the aggregator to be healthy; 0: don't wait.")
    ] = 180.0,
    skip_gpu_check: Annotated[bool, typer.Option(
        "--skip-gpu-check", help="Start GPU profiles even if this host shows no NVIDIA "
        "Container Toolkit (e.g. a remote engine).")] = False,
) -> None:
    """Start the aggregator and the profile's nodes (detached), then show them."""
    from fedgpu.cli import deploy

    project = _project(compose_file, project_name, profile)
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
    project.compose("up", "-d", "--no-build", "--remove-orphans",
                    profiles=[profile] if profile else [])
    if wait_s > 0:
        _wait_healthy(project, client, wait_s)
    _print_ps(deploy.ps(project, client, profile))


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


def down(
    compose_file: ComposeFile = None, project_name: ProjectName = None,
    volumes: Annotated[bool, typer.Option(
        "--volumes", "-v", help="Also delete the volumes: checkpoints and node data.")
    ] = False,
) -> None:
    """Stop and remove every profile's containers (checkpoints kept unless --volumes)."""
    from fedgpu.cli import deploy

    project = _project(compose_file, project_name, None)
    deploy.engine()
    project.compose("down", "--remove-orphans", *(["--volumes"] if volumes else []),
                    profiles=list(deploy.PROFILES))
    typer.echo(f"project {project.name} is down" + (" (volumes deleted)" if volumes else ""))


def ps(
    profile: Profile = None, compose_file: ComposeFile = None, project_name: ProjectName = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """Each service: state, health, GPU reservation and the node's GPU decision."""
    from fedgpu.cli import deploy

    project = _project(compose_file, project_name, profile)
    doc = deploy.ps(project, deploy.engine(), profile)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        _print_ps(doc)


def _print_ps(doc: dict[str, Any]) -> None:
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


def logs(
    services: Annotated[list[str] | None, typer.Argument(
        help="Services to show (default: all of the project's).")] = None,
    profile: Profile = None, compose_file: ComposeFile = None, project_name: ProjectName = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")
                      ] = False,
    tail: Annotated[str, typer.Option(help="Lines per container from the end, or 'all'.")
                    ] = "all",
) -> None:
    """The containers' logs, interleaved, each line prefixed with its service."""
    from fedgpu.cli import deploy

    if tail != "all" and not tail.isdigit():
        raise ConfigError(f"--tail must be a number or 'all', not {tail!r}")
    if follow:
        from fedgpu.core.lifetime import restore_ctrl_c

        # --follow runs until Ctrl-C, even when started with SIGINT ignored (a script's `&`).
        restore_ctrl_c()
    project = _project(compose_file, project_name, profile)
    wanted = list(services) if services else (project.services(profile) if profile else None)
    deploy.logs(project, deploy.engine(), wanted, follow, int(tail) if tail.isdigit() else tail)


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("down")(down)
    app.command("ps")(ps)
    app.command("logs")(logs)
