"""The training subprocess on a real CUDA device; skipped unless torch sees one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from fedgpu.core import codec
from fedgpu.core.datasets import split_digits
from fedgpu.node import weights
from fedgpu.node.tasks.digits import DigitsTask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device seen by torch"),
]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split_digits(tmp_path_factory.mktemp("split"), 2, seed=3)[0]


def _run(workdir: Path, kind: str, data_dir: Path, payload: bytes | None = None, **over: Any):
    workdir.mkdir(parents=True, exist_ok=True)
    task = {
        "kind": kind,
        "task_name": "digits",
        "hyperparameters": {"local_epochs": 2},
        "seed": 1,
        "round": 1,
        "data_dir": str(data_dir),
        "device": "cuda:0",
        "memory_fraction": 0.5,
        "torch_threads": 1,
    }
    task.update(over)
    (workdir / "task.json").write_text(json.dumps(task))
    if payload is not None:
        (workdir / "weights.in.safetensors").write_bytes(payload)
    return subprocess.run(
        [sys.executable, "-m", "fedgpu.node.rounds.worker", str(workdir)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_worker_trains_on_cuda(tmp_path: Path, node_dir: Path) -> None:
    init = _run(tmp_path / "init", "init", node_dir)
    assert init.returncode == 0, init.stderr
    initial = (tmp_path / "init" / "weights.out.safetensors").read_bytes()

    train = _run(tmp_path / "train", "train", node_dir, initial)
    assert train.returncode == 0, train.stderr
    result = json.loads((tmp_path / "train" / "result.json").read_text())
    assert result["torch_peak_allocated_mib"] > 0
    assert result["torch_peak_reserved_mib"] >= result["torch_peak_allocated_mib"]
    assert result["device_name"] == torch.cuda.get_device_name(0)
    trained = (tmp_path / "train" / "weights.out.safetensors").read_bytes()
    assert codec.spec(codec.decode(trained)[0]) == codec.spec(codec.decode(initial)[0])

    evaluate = _run(tmp_path / "eval", "evaluate", node_dir, trained)
    assert evaluate.returncode == 0, evaluate.stderr
    after = json.loads((tmp_path / "eval" / "result.json").read_text())["eval_metrics"]
    assert after["accuracy"] > result["eval_metrics"]["accuracy"] + 0.3


def test_bf16_weights_on_cuda_come_back_as_bf16(tmp_path: Path, node_dir: Path) -> None:
    torch.manual_seed(0)
    arrays = weights.state_arrays(DigitsTask().build_model({}))
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in arrays.items()}
    proc = _run(tmp_path, "train", node_dir, codec.encode(bf16).to_bytes())
    assert proc.returncode == 0, proc.stderr
    out, _ = codec.decode((tmp_path / "weights.out.safetensors").read_bytes())
    assert codec.spec(out) == codec.spec(bf16)


def test_weights_are_loaded_into_the_model_on_cuda(tmp_path: Path) -> None:
    torch.manual_seed(0)
    arrays = weights.state_arrays(DigitsTask().build_model({}))
    weights.write_weights(tmp_path / "w.safetensors", arrays)
    device = torch.device("cuda:0")
    with device:
        model = DigitsTask().build_model({})
    params_before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    weights.load_into(model, weights.read_arrays(tmp_path / "w.safetensors"))
    state = model.state_dict()
    assert {t.device for t in state.values()} == {device}
    # Written into the device tensors the model already had: no second copy of the model.
    assert {k: v.data_ptr() for k, v in state.items()} == params_before
    for name, arr in arrays.items():
        np.testing.assert_array_equal(state[name].cpu().numpy(), arr)


def test_out_of_memory_is_reported_as_oom(tmp_path: Path, node_dir: Path) -> None:
    torch.manual_seed(0)
    initial = codec.encode(weights.state_arrays(DigitsTask().build_model({}))).to_bytes()
    # A share of the card far below what one batch needs, so the caching allocator refuses.
    _, total = torch.cuda.mem_get_info(0)
    proc = _run(tmp_path, "train", node_dir, initial, memory_fraction=(64 << 10) / total,
                hyperparameters={"batch_size": 1024})
    assert proc.returncode == 3, proc.stderr
    err = json.loads((tmp_path / "error.json").read_text())
    assert err["kind"] == "oom" and "--gpu-memory-fraction" in err["error"]
