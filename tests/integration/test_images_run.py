"""The images task end to end: `fedgpu data synth-images`, then a 3-node `fedgpu run --task
images` on that split, learns the synthetic classes (>= 0.5 held-out accuracy).

Kept within make test's budget on 2 busy cores by the job's hyperparameters, not by the data:
the split is the one the issue names (3 nodes, 10 classes, 200 per class, 32x32), the model a
ResNet-8 of width 8 (20k parameters; the task's default is ResNet-18), 2 rounds of 1 epoch.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from fedgpu.cli.run.data import existing_split, node_dirs, parse_hparams
from fedgpu.core.errors import FedgpuError
from tests.fixtures.federation import FEDGPU, ROOT, base_env, cli


def test_synth_images_then_fedgpu_run_task_images_learns(tmp_path: Path) -> None:
    data = tmp_path / "data"
    made = cli("data", "synth-images", "--out", str(data), "--nodes", "3", "--classes", "10",
               "--per-class", "200", timeout=300)
    assert made.returncode == 0, made.stderr
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [*FEDGPU, "run", "--task", "images", "--data", str(data), "--nodes", "3", "--rounds",
         "2", "--gpu", "none", "--run-dir", str(run_dir), "--hp", "depth=8", "--hp", "width=8"],
        capture_output=True, text=True, env=base_env(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    acc = float(re.search(r"final global model: accuracy ([\d.]+)", r.stdout).group(1))
    assert acc >= 0.5, r.stdout
    assert "on 1200 held-out examples of 3 nodes" in r.stdout  # 40 per class and node
    job = (run_dir / "job.toml").read_text()
    assert 'task = "images"' in job and "depth = 8" in job
    rounds = json.loads((run_dir / "rounds.json").read_text())["rounds"]
    for update in rounds[-1]["updates"]:
        # The runner's loop reports its throughput with the task's metrics.
        metrics = update["train_metrics"]
        assert metrics["steps"] == 1600 // 64 and metrics["examples_per_s"] > 0
        assert update["num_examples"] == 1600
    # The run used the split it was given and made none of its own.
    assert not (run_dir / "data").exists()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps


def test_run_data_makes_or_checks_each_nodes_directory(tmp_path: Path) -> None:
    (made,) = node_dirs("images", tmp_path / "made", 1, "iid", 0.5, 0, None)
    meta = json.loads((made / "meta.json").read_text())
    assert meta["num_train"] == 1600 and len(meta["classes"]) == 10
    assert existing_split(tmp_path / "made", 1) == [made.resolve()]
    with pytest.raises(FedgpuError, match=r"has no node-2 for 2 node\(s\) \(it holds 1\): "
                       "use --nodes 1"):
        existing_split(tmp_path / "made", 2)
    with pytest.raises(FedgpuError, match="synthetic images are IID"):
        node_dirs("images", tmp_path / "x", 1, "dirichlet", 0.5, 0, None)
    with pytest.raises(FedgpuError, match="pass --data DIR"):
        node_dirs("other", tmp_path / "x", 1, "iid", 0.5, 0, None)


def test_hp_pairs_are_read_as_json_or_strings() -> None:
    assert parse_hparams(["depth=8", "amp=bf16", "compile=true", "lr=0.1", 'x="7"']) == {
        "depth": 8, "amp": "bf16", "compile": True, "lr": 0.1, "x": "7"}
    r = cli("run", "--task", "images", "--hp", "depth", "--nodes", "1")
    assert r.returncode != 0 and "--hp takes KEY=VALUE" in r.stderr
    r = cli("run", "--task", "nope", "--nodes", "1")
    assert r.returncode != 0 and "--task 'nope' is not installed here" in r.stderr
