"""The host's admin CLI against a compose project, and waiting on it: what the compose tests
share (`fedgpu ... --json` from the host, on the project's published port, with the operator
token and certificate the project's `certs` service made)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from typing import Any, TypeVar

from tests.fixtures.polling import poll

from .dockerutil import ComposeProject, fedgpu_cli

T = TypeVar("T")

# How long a whole federation may take on a loaded machine (images already built).
FEDERATION_TIMEOUT_S = float(os.environ.get("FEDGPU_E2E_FEDERATION_TIMEOUT", "480"))
# What a --gpu enforce node without a GPU names in its one-line refusal.
TOOLKIT_HINT = "NVIDIA Container Toolkit"


def admin(project: ComposeProject, command: str) -> dict[str, Any] | None:
    """`fedgpu <command> --json` from the host against the published port; None while the
    aggregator does not answer yet."""
    proc = subprocess.run(
        [fedgpu_cli(), command, "--address", project.address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=project.admin_env,
    )
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout)


def job_cli(project: ComposeProject, *args: str) -> Any:
    """`fedgpu job <args> --json` from the host; fails the test with stderr on an error."""
    proc = subprocess.run([fedgpu_cli(), "job", *args, "--address", project.address, "--json"],
                          capture_output=True, text=True, timeout=120, env=project.admin_env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float,
             interval: float = 3.0) -> T:
    return poll(probe, timeout, what, interval)


def exited(project: ComposeProject, service: str) -> dict[str, Any] | None:
    """The service's container once it has exited, else None."""
    container = project.container(service)
    return container if container.get("State") == "exited" else None
