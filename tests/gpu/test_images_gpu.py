"""The images task's streaming round on a real CUDA device, every GPU switch on; skipped unless
torch sees one. What the CPU cannot show: pinned-memory non_blocking copies feeding bf16/fp16
autocast on channels_last batches, the fp16 GradScaler, cuDNN autotuning and torch.compile."""

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
from fedgpu.core.synth_images import synth_images

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device seen by torch"),
]
REPO = Path(__file__).resolve().parents[2]
HP = {"depth": 20, "batch_size": 64, "num_workers": 2, "local_epochs": 2,
      "channels_last": True, "cudnn_benchmark": True}


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_images(tmp_path_factory.mktemp("img"), 1, classes=10, per_class=40)[0]


def _round(workdir: Path, kind: str, data_dir: Path, hp: dict[str, Any],
           payload: bytes | None = None) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "task.json").write_text(json.dumps({
        "kind": kind, "task_name": "images", "hyperparameters": hp, "seed": 1, "round": 1,
        "data_dir": str(data_dir), "device": "cuda:0", "memory_fraction": None,
        "torch_threads": 2}))
    if payload is not None:
        (workdir / "weights.in.safetensors").write_bytes(payload)
    out = subprocess.run([sys.executable, "-m", "fedgpu.node.rounds.worker", str(workdir)],
    cwd=REPO,
                         env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((workdir / "result.json").read_text())


@pytest.mark.parametrize("switches", [{"amp": "bf16"}, {"amp": "fp16"},
                                      {"amp": "bf16", "compile": True}])
def test_a_streaming_round_trains_on_the_gpu(tmp_path: Path, node_dir: Path,
                                             switches: dict[str, Any]) -> None:
    hp = {**HP, **switches}
    _round(tmp_path / "init", "init", node_dir, hp)
    init = (tmp_path / "init" / "weights.out.safetensors").read_bytes()
    result = _round(tmp_path / "train", "train", node_dir, hp, init)
    assert not result["device_name"].startswith("cpu")
    assert result["torch_peak_allocated_mib"] > 0
    assert result["num_examples"] == 10 * 32 and result["train_metrics"]["steps"] == 10
    _round(tmp_path / "eval", "evaluate", node_dir, hp,
           (tmp_path / "train" / "weights.out.safetensors").read_bytes())
    after = json.loads((tmp_path / "eval" / "result.json").read_text())
    assert after["eval_metrics"]["accuracy"] > result["eval_metrics"]["accuracy"]
    out, _ = codec.decode((tmp_path / "train" / "weights.out.safetensors").read_bytes())
    assert all(np.isfinite(a).all() and a.flags["C_CONTIGUOUS"] for a in out.values())
