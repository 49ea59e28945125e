"""`make images OFFLINE=1` says where its torch wheel goes before any slow step."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_offline_build_without_a_torch_wheel_stops_first_and_says_where_to_put_one(
        tmp_path: Path) -> None:
    env = {**os.environ, "FEDGPU_TORCH_WHEEL": str(tmp_path / "no-such-torch.whl"),
           # A docker that would record being called: the check must come before it.
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    marker = tmp_path / "docker-called"
    fake = tmp_path / "docker"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\nexit 0\n")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "images/build.sh"), "--offline"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "needs a local torch wheel" in proc.stderr
    assert "/opt/wheels/" in proc.stderr and "FEDGPU_TORCH_WHEEL" in proc.stderr
    assert "is not a file" in proc.stderr
    assert not marker.exists(), "docker ran before the wheel was checked"
