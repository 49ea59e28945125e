"""Helpers for the container tests (docker CLI and compose plugin).

Everything here shells out to the `docker` CLI (and its compose plugin), exactly as an
operator would. Tests that need a running engine skip with the reason when none answers;
`bash tests/e2e/setup_docker.sh` installs and starts one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from fedgpu.core.constants import PROFILES

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
GPU_IDS_FILE = COMPOSE_DIR / "gpu-device-ids.yaml"
TRACKING_FILE = COMPOSE_DIR / "tracking.yaml"
NO_GPU_FILE = Path(__file__).with_name("no-gpu.override.yaml")
BUILD_SCRIPT = REPO / "images" / "build.sh"

# Tags of their own, so the tests never replace what `make images` built.
SERVER_IMAGE = os.environ.get("FEDGPU_E2E_SERVER_IMAGE", "fedgpu/server:e2e")
NODE_IMAGE = os.environ.get("FEDGPU_E2E_NODE_IMAGE", "fedgpu/node:e2e")


def run(
    args: Sequence[str],
    *,
    timeout: float = 120,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
        )
    return proc


def compose_available() -> str | None:
    """None when `docker compose` works, else why not (config needs no engine)."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH (bash tests/e2e/setup_docker.sh installs it)"
    try:
        proc = run(["docker", "compose", "version"], check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker compose does not run: {exc}"
    if proc.returncode != 0:
        return "no Compose v2 plugin ('docker compose'): bash tests/e2e/setup_docker.sh installs it"
    return None


def engine_available() -> str | None:
    """None when a Docker engine answers, else why not."""
    reason = compose_available()
    if reason:
        return reason
    try:
        proc = run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info timed out: the engine does not answer"
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or ["docker info failed"])[-1]
        return f"no Docker engine reachable ({detail}); bash tests/e2e/setup_docker.sh starts one"
    return None


def compose_config(
    *profiles: str, files: Sequence[Path] = (), env: dict[str, str] | None = None
) -> dict[str, Any]:
    """`docker compose config` as JSON, with the given profiles and override files."""
    args = ["docker", "compose", "-f", str(COMPOSE_FILE)]
    for extra in files:
        args += ["-f", str(extra)]
    for profile in profiles:
        args += ["--profile", profile]
    full_env = {**os.environ, **(env or {})}
    out = run([*args, "config", "--format", "json"], env=full_env, timeout=60).stdout
    return json.loads(out)


def fedgpu_cli() -> str:
    """The host's fedgpu console script (the one installed next to this interpreter)."""
    import sys

    candidate = Path(sys.executable).with_name("fedgpu")
    if candidate.exists():
        return str(candidate)
    found = shutil.which("fedgpu")
    if found is None:
        pytest.skip("the fedgpu CLI is not installed on the host (pip install -e .)")
    return found


class ComposeProject:
    """One compose project with its own name, published port and volumes."""

    def __init__(self, images: dict[str, str], port: int, files: Sequence[Path] = ()) -> None:
        self.name = f"fedgpu-e2e-{uuid.uuid4().hex[:8]}"
        self.port = port
        self.token = uuid.uuid4().hex
        self.operator_token = uuid.uuid4().hex
        self.files = [COMPOSE_FILE, *files]
        self.env = {
            **os.environ,
            "COMPOSE_PROJECT_NAME": self.name,
            "FEDGPU_SERVER_IMAGE": images["server"],
            "FEDGPU_NODE_IMAGE": images["node"],
            "FEDGPU_PUBLISH_PORT": str(port),
            # The bulk port and the dashboard too: their defaults (50052, 8080) may be taken
            # on the host (an aggregator another test started), and one taken port stops `up`.
            "FEDGPU_BULK_PUBLISH_PORT": str(free_port()),
            "FEDGPU_UI_PUBLISH_PORT": str(free_port()),
            "FEDGPU_BIND": "127.0.0.1",
            "FEDGPU_TOKEN": self.token,
            "FEDGPU_OPERATOR_TOKEN": self.operator_token,
            # Each project makes its own CA and key pairs (the `certs` one-shot), here.
            "FEDGPU_CERTS_DIR": str(Path(tempfile.mkdtemp(prefix=f"{self.name}-certs-"))),
            # `fedgpu up` saves the connection "compose" here, not in the user's config.
            "FEDGPU_CONFIG_DIR": str(Path(tempfile.mkdtemp(prefix=f"{self.name}-config-"))),
        }

    @property
    def admin_env(self) -> dict[str, str]:
        """Environment for the host's admin CLI: the operator token and certificate."""
        certs = Path(self.env["FEDGPU_CERTS_DIR"])
        operator = certs / "operators" / "operator"
        return {
            **os.environ,
            "FEDGPU_OPERATOR_TOKEN": self.operator_token,
            "FEDGPU_TLS_CERT": str(operator / "operator.crt"),
            "FEDGPU_TLS_KEY": str(operator / "operator.key"),
            "FEDGPU_TLS_CA": str(certs / "ca.crt"),
        }

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def compose(
        self, *args: str, profiles: Sequence[str] = (), timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        cmd = ["docker", "compose", "-p", self.name]
        for f in self.files:
            cmd += ["-f", str(f)]
        for profile in profiles:
            cmd += ["--profile", profile]
        return run([*cmd, *args], env=self.env, timeout=timeout, check=check)

    def containers(self) -> list[dict[str, Any]]:
        """`compose ps -a` of every profile, one dict per container."""
        out = self.compose("ps", "-a", "--format", "json", profiles=PROFILES).stdout.strip()
        if not out:
            return []
        if out.startswith("["):  # older compose: one JSON array
            return list(json.loads(out))
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def container(self, service: str) -> dict[str, Any]:
        for c in self.containers():
            if c.get("Service") == service:
                return c
        raise AssertionError(f"no container for service {service} in {self.name}")

    def logs(self, *services: str) -> str:
        proc = self.compose(
            "logs", "--no-color", "--no-log-prefix", *services, profiles=PROFILES, check=False
        )
        return proc.stdout + proc.stderr

    def down(self) -> None:
        self.compose(
            "down", "-v", "--remove-orphans", "--timeout", "10", profiles=PROFILES, check=False
        )


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
