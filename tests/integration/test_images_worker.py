"""The images task through real worker processes: a worker forked by a factory that warmed up
on the task's own data, and a broken file reported from a DataLoader worker."""

from __future__ import annotations

import json
import os
import re
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
    return subprocess.run([sys.executable, "-m", "fedgpu.node.rounds.worker", *args], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, input=stdin,
                          capture_output=True, text=True, timeout=180)


def test_a_factory_warms_up_on_the_task_and_its_worker_trains_the_round(
    tmp_path: Path, node_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from fedgpu.node import nvml, policy
    from fedgpu.node.rounds.factory_client import FactoryClient
    from fedgpu.node.rounds.process import run_task

    init = tmp_path / "init"
    init.mkdir()
    (init / "task.json").write_text(json.dumps(_task("init", node_dir)))
    assert _worker(str(init)).returncode == 0
    decision = policy.decide(nvml.snapshot(), policy.parse_gpu_flags("none", None, 0, None),
                             job_use_gpu=False)
    factory = FactoryClient.start_own({**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out = run_task(kind="train", task_name="images", hyperparameters=HP, seed=2,
                       round_number=1, data_dir=node_dir,
                       payload=(init / "weights.out.safetensors").read_bytes(),
                       decision=decision, work_root=tmp_path, sampler=None, torch_threads=1,
                       factory=factory, node_name="img")
    finally:
        factory.close()
    logs = capfd.readouterr().err
    assert out.ok, out.error + logs[-3000:]
    # The factory warmed up on this task's own model and data before it forked the worker.
    assert "warmed up task 'images'" in logs and "warm-up for task" not in logs
    assert re.search(r"worker pid \d+ forked by the factory \d+", logs)
    result = out.result
    metrics = result["train_metrics"]
    assert result["num_examples"] == 4 * 8 and result["num_eval_examples"] == 4 * 2
    assert metrics["steps"] == 2 and metrics["examples_per_s"] > 0
    assert 0 < metrics["first_step_s"] < 120
    assert out.weights is not None and out.weights.stat().st_size > 0
    out.cleanup()


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
    from fedgpu.node.rounds import worker

    data = node_dir if task_name == "images" else split_digits(tmp_path / "d", 1)[0]
    hp = {**(HP if task_name == "images" else {"lr": 0.1}), "amp": "bf16",
          "channels_last": True, "local_params": ["fc*"], "local_params_run": "run1",
          "update_codec": "int8"}
    # Raises if the task were handed the runner's keys (digits refuses unknown ones).
    worker._warm_up({"task_name": task_name, "hyperparameters": hp, "data_dir": str(data)})
