"""`fedgpu run`, the README's `make demo`, end to end: 3 nodes, 5 rounds, accuracy >= 0.90."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.federation import FEDGPU, ROOT, base_env
from tests.fixtures.processes import (
    descendants,
    describe,
    read_until,
    running,
    wait_gone,
    with_signals,
)

# `make demo` end to end: real training, minutes on a loaded machine.
pytestmark = pytest.mark.slow


def test_fedgpu_run_three_nodes_five_rounds(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = subprocess.run([*FEDGPU, "run", "--nodes", "3", "--rounds", "5", "--run-dir",
                        str(run_dir)], capture_output=True, text=True, env=base_env(),
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    for i in range(1, 6):
        assert re.search(rf"round {i}/5: finished, train loss [\d.]+, 3/3 nodes", r.stdout)
    acc = float(re.search(r"final global model: accuracy ([\d.]+)", r.stdout).group(1))
    assert acc >= 0.90
    assert str(run_dir) in r.stdout
    rounds = json.loads((run_dir / "rounds.json").read_text())["rounds"]
    assert len(rounds) == 5 and round(rounds[-1]["eval"]["accuracy"], 4) == acc
    # The run is one job on the local federation: its checkpoints are in that job's directory.
    assert (run_dir / "state" / "fedgpu.db").exists()
    (model,) = (run_dir / "state" / "jobs").glob("*/global.safetensors")
    assert model.stat().st_size > 0
    for name in ("aggregator", "node-1", "node-2", "node-3"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    # Nothing of the run is left running.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_stops_every_process(tmp_path: Path, inherited: str) -> None:
    # SIGINT as a terminal leaves it, and as a script's `cmd &` does (ignored): `fedgpu run`
    # installs its handler itself, so Ctrl-C works either way, however pytest was started.
    run_dir = tmp_path / "run"
    cmd = [*FEDGPU, "run", "--nodes", "2", "--rounds", "50", "--run-dir", str(run_dir)]
    how = {inherited: (signal.SIGINT,)}
    p = subprocess.Popen(with_signals(cmd, **how), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=base_env(), cwd=ROOT)
    try:
        read_until(p, "round 1/50", 240)
        tree = descendants(p.pid)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, out + err
    assert "interrupted (SIGINT)" in out
    assert not wait_gone(tree, timeout=10), describe(running(tree))
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps
    assert (run_dir / "rounds.json").exists()
