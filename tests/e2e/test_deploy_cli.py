"""`fedgpu up|down|ps|logs` on a real engine (marked e2e, skipped without one), and their
one-line refusals when the engine, the CLI or the profile is wrong (no engine needed)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.processes import with_signals

from .dockerutil import REPO, ComposeProject, compose_available

NODES = ("node-cpu-1", "node-cpu-2", "node-cpu-3")


def fedgpu(*args: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedgpu.cli.app", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], r.stderr


# ---- refusals (no engine needed) ------------------------------------------------------


def test_unknown_profile() -> None:
    for cmd in ("up", "ps", "logs"):
        one_line_error(fedgpu(cmd, "--profile", "gpu"), 2, "unknown profile 'gpu': use one of "
                       "cpu, gpu-offered, gpu-enforced, hetero")


def test_no_engine(tmp_path: Path) -> None:
    import os

    # The engine is checked after the docker CLI and Compose v2 (each refusal has its own
    # test): without them this refusal cannot be reached, so say so instead of failing.
    missing = compose_available()
    if missing:
        pytest.skip(f"needs the docker CLI with Compose v2 to reach the engine check: {missing}")
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/dead.sock"}
    for args in (("up", "--profile", "cpu"), ("down",), ("ps",), ("logs", "aggregator")):
        one_line_error(fedgpu(*args, env=env), 1,
                       f"no Docker engine answers at unix://{tmp_path}/dead.sock")


def test_no_docker_cli(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "PATH": str(tmp_path)}  # a PATH with no docker on it
    for args in (("up", "--profile", "cpu"), ("ps",)):
        one_line_error(fedgpu(*args, env=env), 1, "no docker CLI on PATH: install Docker "
                       "Engine with the Compose v2 plugin")


def test_bad_flags() -> None:
    r = fedgpu("up", "--no-such-flag")
    assert r.returncode == 2 and "No such option" in r.stderr and r.stdout == ""
    one_line_error(fedgpu("logs", "--tail", "lots"), 2, "--tail must be a number or 'all'")
    one_line_error(fedgpu("ps", "--compose-file", "/nonexistent/compose.yaml"), 2,
                   "compose file /nonexistent/compose.yaml does not exist")


# ---- on a real engine -----------------------------------------------------------------


def ps_json(project: ComposeProject, *args: str) -> dict[str, Any]:
    r = fedgpu("ps", "--json", *args, env=project.env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def by_service(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["service"]: s for s in doc["services"]}


@pytest.mark.e2e
def test_missing_images_are_named(compose_project: Any) -> None:
    project: ComposeProject = compose_project()
    env = {**project.env, "FEDGPU_NODE_IMAGE": "fedgpu/node:no-such-tag"}
    one_line_error(fedgpu("up", "--profile", "cpu", env=env), 1,
                   "image(s) fedgpu/node:no-such-tag not in the engine: build them with "
                   "'make images'")
    assert ps_json(project)["services"] == []  # nothing was started


@pytest.mark.e2e
def test_gpu_profile_reservations_and_toolkit_check(compose_project: Any) -> None:
    project: ComposeProject = compose_project()
    r = fedgpu("up", "--profile", "gpu-enforced", "--wait-s", "0", env=project.env)
    if r.returncode == 0:
        pytest.skip("this engine has the NVIDIA toolkit: the refusal cannot be staged")
    one_line_error(r, 1, "profile gpu-enforced reserves NVIDIA GPUs, but")
    assert "--profile cpu" in r.stderr
    # Created, not started (starting needs the toolkit): ps reads each reservation as the
    # engine holds it.
    project.compose("create", "node-gpu-offered-1", "node-cpu-1", profiles=["hetero"])
    services = by_service(ps_json(project))
    res = services["node-gpu-offered-1"]["gpu_reservation"]
    assert res == {"driver": "nvidia", "count": 1, "device_ids": None,
                   "capabilities": ["gpu"]}
    assert services["node-gpu-offered-1"]["state"] == "created"
    assert services["node-cpu-1"]["gpu_reservation"] is None


@pytest.mark.e2e
def test_up_ps_logs_down(compose_project: Any) -> None:
    project: ComposeProject = compose_project()
    env = project.env
    r = fedgpu("up", "--profile", "cpu", env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"project {project.name}" in r.stdout and "healthy" in r.stdout

    # The nodes write their GPU decision once they have made it; ps reads it from them.
    deadline = time.monotonic() + 180
    while True:
        services = by_service(ps_json(project, "--profile", "cpu"))
        if all((services.get(n) or {}).get("gpu_decision") for n in NODES):
            break
        assert time.monotonic() < deadline, services
        time.sleep(3)
    assert set(services) == {"aggregator", "certs", "data-split", *NODES}
    agg = services["aggregator"]
    assert agg["health"] == "healthy" and agg["state"] == "running"
    assert agg["gpu_reservation"] is None and agg["gpu_decision"] is None
    assert any(p.endswith(f":{project.port}->50051/tcp") for p in agg["ports"])
    assert services["data-split"]["state"] == "exited"
    assert services["data-split"]["exit_code"] == 0
    assert services["certs"]["state"] == "exited" and services["certs"]["exit_code"] == 0
    for name in NODES:
        node = services[name]
        assert node["gpu_reservation"] is None
        assert node["gpu_decision"]["mode"] == "none"
        assert node["gpu_decision"]["device"] == "cpu" and node["gpu_decision"]["reason"]
    table = fedgpu("ps", env=env)
    assert table.returncode == 0 and "node-cpu-1" in table.stdout and "healthy" in table.stdout

    # `up` saved the aggregator as the default connection: the admin commands need no
    # address, certificate or token (none is in this environment).
    assert "saved connection 'compose'" in r.stderr, r.stderr
    bare = {k: v for k, v in env.items() if not k.startswith(("FEDGPU_TLS_", "FEDGPU_OPER",
                                                               "FEDGPU_AGGREGATOR"))}
    status = fedgpu("status", "--json", env=bare)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] in ("waiting", "running", "finished")

    logs = fedgpu("logs", "aggregator", env=env)
    assert logs.returncode == 0
    lines = logs.stdout.splitlines()
    assert lines and all(ln.startswith("aggregator | ") for ln in lines)
    assert any("listening on 0.0.0.0:50051" in ln for ln in lines)
    assert any("node-cpu-1 registered" in ln for ln in lines)
    both = fedgpu("logs", "--tail", "5", "aggregator", "node-cpu-2", env=env).stdout.splitlines()
    assert {ln.split(" | ")[0].strip() for ln in both} == {"aggregator", "node-cpu-2"}
    assert len(both) <= 10

    # Started with SIGINT ignored, as a script's `cmd &` (and `nohup make test &`) leaves it:
    # --follow installs its own Ctrl-C handler, so this holds however the tests were started.
    follow = subprocess.Popen(
        with_signals([sys.executable, "-m", "fedgpu.cli.app", "logs", "--follow", "--tail", "1",
                      "aggregator"], ignored=(signal.SIGINT,)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    assert follow.stdout is not None
    assert follow.stdout.readline().startswith("aggregator | ")
    follow.send_signal(signal.SIGINT)
    follow.communicate(timeout=60)
    assert follow.returncode == 130

    down = fedgpu("down", env=env, timeout=300)
    assert down.returncode == 0, down.stderr
    # `fedgpu up` made the deployment the default connection; `down` retires it, so the next
    # command does not dial a deployment that is gone.
    assert down.stdout.splitlines() == [f"project {project.name} is down",
                                         "removed connection 'compose' (the deployment is down)"]
    saved = json.loads(fedgpu("connection", "list", "--json", env=env).stdout)
    assert "compose" not in [c["name"] for c in saved["connections"]]
    assert ps_json(project)["services"] == []
