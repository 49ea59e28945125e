"""The images task through `python -m fedgpu.node.worker` as real subprocesses: a pre-started
worker warmed up on the task's own data, and a broken file reported from a DataLoader worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fedgpu.core.synth_images import synth_images

REPO = Path(__file__).resolve().parents[2]
HP = {"depth": 8, "width": 4, "image_size": 16, "batch_size": 16, "num_workers": 1}


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_images(tmp_path_factory.mktemp("img"), 1, classes=4, per_class=10, size=16)[0]


def _task(kind: str, data_dir: Path, **hp: Any) -> dict[str, Any]:
    return {"kind": kind, "task_name": "images", "hyperparameters": {**HP, **hp}, "seed": 2,
            "round": 1, "data_dir": str(data_dir), "device": "cpu", "memory_fraction": None,
            "torch_threads": 1}


def _worker(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedgpu.node.worker", *args], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, input=stdin,
                          capture_output=True, text=True, timeout=180)


def test_a_prestarted_worker_warms_up_on_the_task_and_trains_the_round(
    tmp_path: Path, node_dir: Path
) -> None:
    init = tmp_path / "init"
    init.mkdir()
    (init / "task.json").write_text(json.dumps(_task("init", node_dir)))
    assert _worker(str(init)).returncode == 0
    work = tmp_path / "train"
    work.mkdir()
    (work / "task.json").write_text(json.dumps(_task("train", node_dir)))
    (init / "weights.out.safetensors").rename(work / "weights.in.safetensors")
    hint = {"task_name": "images", "hyperparameters": HP, "data_dir": str(node_dir)}
    out = _worker("--standby", json.dumps(hint),
                  stdin=json.dumps({"workdir": str(work), "env": {}}) + "\n")
    assert out.returncode == 0, out.stderr
    assert "standby warm-up failed" not in out.stderr
    assert "pre-started worker: ready after" in out.stderr
    result = json.loads((work / "result.json").read_text())
    metrics = result["train_metrics"]
    assert result["num_examples"] == 4 * 8 and result["num_eval_examples"] == 4 * 2
    assert metrics["steps"] == 2 and metrics["examples_per_s"] > 0
    assert 0 < metrics["first_step_s"] < 120
    assert (work / "weights.out.safetensors").stat().st_size > 0


def test_an_undecodable_image_is_bad_input_named_by_its_path(
    tmp_path: Path, node_dir: Path
) -> None:
    broken = synth_images(tmp_path / "split", 1, classes=4, per_class=10, size=16)[0]
    bad = broken / "train" / "class-2" / "000005.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    work = tmp_path / "w"
    work.mkdir()
    (work / "task.json").write_text(json.dumps(_task("init", broken)))
    assert _worker(str(work)).returncode == 0
    (work / "weights.out.safetensors").rename(work / "weights.in.safetensors")
    (work / "task.json").write_text(json.dumps(_task("train", broken)))
    out = _worker(str(work))
    assert out.returncode == 2, out.stderr
    err = json.loads((work / "error.json").read_text())
    assert err["kind"] == "bad_input"
    assert err["error"].startswith(f"cannot decode image {bad}")
    assert err["error"].endswith("(in a DataLoader worker)") and "\n" not in err["error"]


@pytest.mark.parametrize("task_name", ["digits", "images"])
def test_the_warm_up_takes_the_runner_switches_out_for_either_contract(
    tmp_path: Path, node_dir: Path, task_name: str
) -> None:
    from fedgpu.core.datasets import split_digits
    from fedgpu.node import worker

    data = node_dir if task_name == "images" else split_digits(tmp_path / "d", 1)[0]
    hp = {**(HP if task_name == "images" else {"lr": 0.1}), "amp": "bf16",
          "channels_last": True}
    # Raises if the task were handed the runner's keys (digits refuses unknown ones).
    worker._warm_up({"task_name": task_name, "hyperparameters": hp, "data_dir": str(data)})
