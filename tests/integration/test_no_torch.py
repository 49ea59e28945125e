"""The aggregator and the node agent never import torch (fresh interpreters prove it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.fixtures.federation import ROOT, Federation, base_env, write_job

AGENT = """
import sys
import fedgpu.node.agent, fedgpu.node.rounds.process, fedgpu.node.client
import fedgpu.node.nvml, fedgpu.node.policy, fedgpu.node.tasks
# Many agents in one process, and their side of the worker factory (which imports torch in
# its own process only, in main()).
import fedgpu.node.fleet, fedgpu.node.rounds.factory_client, fedgpu.node.rounds.factory
import fedgpu.node.rounds.fork
fedgpu.node.tasks.available_tasks()
bad = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
print("IMPORTED:", bad)
sys.exit(1 if bad else 0)
"""


def imported(log: str) -> set[str]:
    # -X importtime lines: "import time: self | cumulative | package.module"
    return {m.group(1).strip() for m in re.finditer(r"import time:.*\|\s*(\S+)\s*$", log, re.M)}


def test_aggregator_never_imports_torch(federation: Federation, tmp_path: Path) -> None:
    env = base_env(FEDGPU_TOKEN=federation.token, PYTHONPROFILEIMPORTTIME="1")
    proc = federation.start_server(write_job(tmp_path / "job.toml"), env=env)
    assert federation.query("GetStatus")["state"] == "waiting"
    proc.stop()
    assert proc.popen.returncode is not None
    modules = imported(proc.text())
    assert "fedgpu.server.app" in modules and "grpc" in modules  # the profile really was taken
    assert not {m for m in modules if m.split(".")[0] in ("torch", "sklearn")}


def test_node_agent_never_imports_torch() -> None:
    r = subprocess.run([sys.executable, "-c", AGENT], capture_output=True, text=True,
                       env=base_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
