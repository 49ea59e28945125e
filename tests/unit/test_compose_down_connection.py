"""`make down` retires the connection `make up` made the default: the next command must not
dial a deployment that is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FEDGPU = Path(sys.executable).parent / "fedgpu"


def _fake_docker(bin_dir: Path, log: Path) -> None:
    # Docker is not the layer under test (there is no engine here): this one answers the
    # script's checks and records the compose call.
    docker = bin_dir / "docker"
    docker.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 0\n')
    docker.chmod(0o755)


def _connections(env: dict[str, str]) -> dict:
    out = subprocess.run([str(FEDGPU), "connection", "list", "--json"], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_down_removes_the_compose_connection_and_keeps_the_others(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "docker.log"
    _fake_docker(bin_dir, log)
    # The script prefers the checkout's .venv CLI; PATH gives it ours when there is none.
    env = {**os.environ, "FEDGPU_CONFIG_DIR": str(tmp_path / "config"),
           "PATH": f"{bin_dir}:{FEDGPU.parent}:{os.environ['PATH']}"}
    for name in ("prod", "compose"):
        subprocess.run([str(FEDGPU), "connection", "add", name, "--address",
                        "127.0.0.1:50051", "--insecure"], env=env, check=True,
                       capture_output=True, timeout=60)
    assert _connections(env)["default"] == "prod"
    subprocess.run([str(FEDGPU), "connection", "use", "compose"], env=env, check=True,
                   capture_output=True, timeout=60)

    proc = subprocess.run(["bash", str(ROOT / "compose/compose.sh"), "down"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "down --remove-orphans" in log.read_text()
    after = _connections(env)
    assert [c["name"] for c in after["connections"]] == ["prod"]
    assert after["default"] is None
    assert "removed connection 'compose'" in proc.stderr

    # A second `down` with nothing to retire still succeeds, quietly.
    again = subprocess.run(["bash", str(ROOT / "compose/compose.sh"), "down"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "compose" not in again.stderr.replace("compose.sh", "")


def test_fedgpu_down_retires_the_same_connection(tmp_path: Path, monkeypatch) -> None:
    from fedgpu.cli.deploy.compose import retire_connection

    monkeypatch.setenv("FEDGPU_CONFIG_DIR", str(tmp_path / "config"))
    env = {**os.environ}
    assert retire_connection() is None
    subprocess.run([str(FEDGPU), "connection", "add", "compose", "--address",
                    "127.0.0.1:50051", "--insecure"], env=env, check=True,
                   capture_output=True, timeout=60)
    assert "removed connection 'compose'" in (retire_connection() or "")
    assert _connections(env)["connections"] == []
