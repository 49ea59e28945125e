"""`python -m fedgpu.node.rounds.worker WORKDIR` as a real subprocess: its file contract with the
agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedgpu.core import codec
from fedgpu.core.datasets import split_digits
from fedgpu.node import weights
from fedgpu.node.tasks.digits import DigitsTask

REPO = Path(__file__).resolve().parents[2]
RESULT_KEYS = {
    "num_examples",
    "train_metrics",
    "eval_metrics",
    "num_eval_examples",
    "torch_peak_allocated_mib",
    "torch_peak_reserved_mib",
    "rss_peak_mib",
    "train_seconds",
    "device_name",
    "rank_train_seconds",
    "statistics",
}


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split_digits(tmp_path_factory.mktemp("split"), 2, seed=3)[0]


@pytest.fixture(scope="module")
def initial() -> bytes:
    # Built in-process rather than by an init subprocess, to keep the error tests quick.
    torch.manual_seed(0)
    return codec.encode(weights.state_arrays(DigitsTask().build_model({}))).to_bytes()


def task_json(kind: str, data_dir: Path, **over: Any) -> dict[str, Any]:
    task = {
        "kind": kind,
        "task_name": "digits",
        "hyperparameters": {"local_epochs": 2},
        "seed": 11,
        "round": 1,
        "data_dir": str(data_dir),
        "device": "cpu",
        "memory_fraction": None,
        "torch_threads": 1,
    }
    task.update(over)
    return task


def run_worker(
    workdir: Path, task: dict[str, Any] | str, weights: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "task.json").write_text(task if isinstance(task, str) else json.dumps(task))
    if weights is not None:
        (workdir / "weights.in.safetensors").write_bytes(weights)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "fedgpu.node.rounds.worker", str(workdir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_init_train_evaluate(tmp_path: Path, node_dir: Path) -> None:
    init = run_worker(tmp_path / "init", task_json("init", node_dir))
    assert init.returncode == 0, init.stderr
    initial = (tmp_path / "init" / "weights.out.safetensors").read_bytes()
    init_tensors, _ = codec.decode(initial)
    assert codec.spec(init_tensors)["fc2.weight"] == ("F32", (10, 64))
    init_result = read_json(tmp_path / "init" / "result.json")
    assert set(init_result) == RESULT_KEYS and init_result["num_examples"] == 0

    train = run_worker(tmp_path / "train", task_json("train", node_dir), initial)
    assert train.returncode == 0, train.stderr
    result = read_json(tmp_path / "train" / "result.json")
    assert set(result) == RESULT_KEYS
    meta = read_json(node_dir / "meta.json")
    assert result["num_examples"] == meta["num_train"]
    assert result["num_eval_examples"] == meta["num_test"]
    assert set(result["train_metrics"]) == {"loss", "accuracy", "steps", "examples",
                                            "examples_per_s"}
    # The runner's clock over the task's own loop: examples per second of training.
    metrics = result["train_metrics"]
    assert metrics["examples_per_s"] == pytest.approx(
        metrics["examples"] / result["train_seconds"], rel=0.01)
    assert set(result["eval_metrics"]) == {"loss", "accuracy"}
    assert result["torch_peak_allocated_mib"] == -1 and result["torch_peak_reserved_mib"] == -1
    assert result["rss_peak_mib"] > 50 and result["train_seconds"] > 0
    assert result["device_name"].startswith("cpu")
    assert not (tmp_path / "train" / "error.json").exists()

    trained = (tmp_path / "train" / "weights.out.safetensors").read_bytes()
    trained_tensors, _ = codec.decode(trained)
    assert codec.spec(trained_tensors) == codec.spec(init_tensors)
    assert all(np.isfinite(t).all() for t in trained_tensors.values())

    evaluate = run_worker(tmp_path / "eval", task_json("evaluate", node_dir), trained)
    assert evaluate.returncode == 0, evaluate.stderr
    after = read_json(tmp_path / "eval" / "result.json")
    assert not (tmp_path / "eval" / "weights.out.safetensors").exists()
    assert after["num_examples"] == 0 and after["train_metrics"] == {}
    # The train round scored the model it received (the initial one) before training.
    before = result["eval_metrics"]
    assert after["eval_metrics"]["accuracy"] > before["accuracy"] + 0.3
    assert after["eval_metrics"]["loss"] < before["loss"]


def _error(workdir: Path) -> dict[str, Any]:
    err = read_json(workdir / "error.json")
    assert set(err) == {"error", "kind"} and "\n" not in err["error"]
    assert not (workdir / "result.json").exists()
    return err


def test_unknown_task_is_bad_input(tmp_path: Path, node_dir: Path) -> None:
    proc = run_worker(tmp_path, task_json("init", node_dir, task_name="cifar"))
    assert proc.returncode == 2
    err = _error(tmp_path)
    assert err["kind"] == "bad_input"
    assert "unknown task 'cifar'" in err["error"] and "digits" in err["error"]
    assert "unknown task 'cifar'" in proc.stderr


def test_missing_data_dir_is_bad_input(tmp_path: Path, initial: bytes) -> None:
    proc = run_worker(tmp_path, task_json("evaluate", tmp_path / "absent"), initial)
    assert proc.returncode == 2
    err = _error(tmp_path)
    assert err["kind"] == "bad_input"
    assert "does not exist" in err["error"] and "fedgpu data split" in err["error"]


def test_corrupt_weights_are_bad_input(tmp_path: Path, node_dir: Path, initial: bytes) -> None:
    payload = bytearray(initial)
    del payload[-100:]  # a truncated transfer
    proc = run_worker(tmp_path / "w", task_json("train", node_dir), bytes(payload))
    assert proc.returncode == 2
    err = _error(tmp_path / "w")
    assert err["kind"] == "bad_input"
    assert "weights.in.safetensors are not a valid safetensors payload" in err["error"]
    assert not (tmp_path / "w" / "weights.out.safetensors").exists()


def test_unreadable_task_json_is_bad_input(tmp_path: Path) -> None:
    proc = run_worker(tmp_path, "{not json")
    assert proc.returncode == 2
    assert _error(tmp_path)["kind"] == "bad_input"
