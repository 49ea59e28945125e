"""fedgpu.node.runner in-process: task.json validation, failure classification, one round's work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from fedgpu.core import codec
from fedgpu.core.datasets import split_digits
from fedgpu.node import runner, weights
from fedgpu.node.workfiles import WEIGHTS_IN, WEIGHTS_OUT

BASE: dict[str, Any] = {
    "kind": "train",
    "task_name": "digits",
    "hyperparameters": {},
    "seed": 1,
    "round": 2,
    "data_dir": "/data",
    "device": "cpu",
    "memory_fraction": None,
    "torch_threads": 1,
}


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split_digits(tmp_path_factory.mktemp("split"), 3, seed=1)[0]


def test_parse_spec_accepts_the_contract() -> None:
    spec = runner.parse_spec(BASE)
    assert spec.kind == "train" and spec.data_dir == Path("/data") and spec.torch_threads == 1
    spec = runner.parse_spec({**BASE, "kind": "init", "data_dir": None, "memory_fraction": 0.5})
    assert spec.data_dir is None and spec.memory_fraction == 0.5


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"kind": "predict"}, "'kind' must be one of init, train, evaluate"),
        ({"seed": True}, "'seed' must be an integer"),
        ({"seed": None}, "'seed' must be an integer"),
        ({"device": "tpu"}, "'device' must be 'cpu' or 'cuda:N'"),
        ({"device": "mps"}, "'device' must be 'cpu' or 'cuda:N'"),
        ({"memory_fraction": 1.5}, "'memory_fraction' must be in (0, 1]"),
        ({"torch_threads": 0}, "'torch_threads' must be >= 1"),
        ({"hyperparameters": []}, "'hyperparameters' must be an object"),
        ({"data_dir": None}, "'data_dir' must be a path"),
    ],
)
def test_parse_spec_refuses_bad_fields(change: dict[str, Any], needle: str) -> None:
    with pytest.raises(runner.BadInputError) as info:
        runner.parse_spec({**BASE, **change})
    assert needle in str(info.value)


def test_parse_spec_names_a_missing_field() -> None:
    raw = dict(BASE)
    del raw["task_name"]
    with pytest.raises(runner.BadInputError, match="'task_name' is missing"):
        runner.parse_spec(raw)


def test_cuda_on_a_machine_without_it_is_bad_input(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    spec = runner.parse_spec({**BASE, "kind": "init", "device": "cuda:0"})
    with pytest.raises(runner.BadInputError, match="asks for cuda:0 but this torch build sees no"):
        runner.run_round(spec, tmp_path)


def test_classify() -> None:
    oom = runner.classify(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert oom.kind == "oom" and oom.exit_code == 3
    assert "batch_size" in oom.message and "--gpu-memory-fraction" in oom.message
    bad = runner.classify(codec.CodecError("bad\nheader"))
    assert bad.kind == "bad_input" and bad.exit_code == 2 and bad.message == "bad header"
    other = runner.classify(KeyError("x"))
    assert other.kind == "exception" and other.exit_code == 1 and other.message == "KeyError: 'x'"


def _spec(kind: str, node_dir: Path, **hp: Any) -> runner.RoundSpec:
    raw = {**BASE, "kind": kind, "data_dir": str(node_dir), "hyperparameters": hp}
    return runner.parse_spec(raw)


def test_bf16_global_model_trains_and_returns_bf16(tmp_path: Path, node_dir: Path) -> None:
    runner.run_round(_spec("init", node_dir), tmp_path)
    init, _ = codec.decode((tmp_path / WEIGHTS_OUT).read_bytes())
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in init.items()}
    weights.write_weights(tmp_path / WEIGHTS_IN, bf16)
    result = runner.run_round(_spec("train", node_dir), tmp_path)
    out, meta = codec.decode((tmp_path / WEIGHTS_OUT).read_bytes())
    assert codec.spec(out) == codec.spec(bf16)
    assert meta == {"task": "digits", "round": "2"}
    assert result.num_examples > 0 and result.eval_metrics["accuracy"] < 0.5


def test_init_is_deterministic_given_the_seed(tmp_path: Path, node_dir: Path) -> None:
    outs = []
    for i, seed in enumerate((5, 5, 6)):
        workdir = tmp_path / str(i)
        workdir.mkdir()
        runner.run_round(runner.parse_spec({**BASE, "kind": "init", "seed": seed}), workdir)
        outs.append((workdir / WEIGHTS_OUT).read_bytes())
    assert outs[0] == outs[1] != outs[2]


def test_weights_of_another_model_are_refused(tmp_path: Path, node_dir: Path) -> None:
    weights.write_weights(tmp_path / WEIGHTS_IN, {"fc.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(weights.WeightsError, match="missing conv1.bias, conv1.weight"):
        runner.run_round(_spec("evaluate", node_dir), tmp_path)


def test_divergence_is_reported_not_shipped(tmp_path: Path, node_dir: Path) -> None:
    runner.run_round(_spec("init", node_dir), tmp_path)
    (tmp_path / WEIGHTS_OUT).rename(tmp_path / WEIGHTS_IN)
    with pytest.raises(runner.DivergedError, match="lower 'lr'") as info:
        runner.run_round(_spec("train", node_dir, lr=1e12), tmp_path)
    assert runner.classify(info.value).kind == "exception"
    assert not (tmp_path / WEIGHTS_OUT).exists()
