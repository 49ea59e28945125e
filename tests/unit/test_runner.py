"""fedgpu.node.rounds.runner in-process: task.json validation, failure classification, one round's
work."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from fedgpu.core import codec
from fedgpu.core.datasets import split_digits
from fedgpu.core.synth_images import synth_images
from fedgpu.node import weights
from fedgpu.node.rounds import runner
from fedgpu.node.rounds.workfiles import WEIGHTS_IN, WEIGHTS_OUT
from fedgpu.node.tasks import HyperparameterError

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


@dataclass(frozen=True)
class Case:
    """One task of each contract: digits returns tensors, images returns Datasets."""

    task_name: str
    node_dir: Path
    hparams: dict[str, Any]


# A small ResNet on 16x16 images keeps the Dataset task as quick as digits on a busy CPU.
_IMAGES_HP = {"depth": 8, "width": 8, "image_size": 16, "batch_size": 32}


@pytest.fixture(scope="module", params=["digits", "images"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    if request.param == "digits":
        return Case("digits", split_digits(tmp_path_factory.mktemp("split"), 3, seed=1)[0], {})
    node_dir = synth_images(tmp_path_factory.mktemp("images"), 1, classes=10, per_class=40,
                            size=16, seed=1)[0]
    return Case("images", node_dir, dict(_IMAGES_HP))


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


def _spec(kind: str, case: Case, seed: int = 1, **hp: Any) -> runner.RoundSpec:
    raw = {**BASE, "kind": kind, "task_name": case.task_name, "seed": seed,
           "data_dir": str(case.node_dir), "hyperparameters": {**case.hparams, **hp}}
    return runner.parse_spec(raw)


def _init(case: Case, workdir: Path, seed: int = 1) -> None:
    runner.run_round(_spec("init", case, seed), workdir)
    (workdir / WEIGHTS_OUT).rename(workdir / WEIGHTS_IN)


def test_bf16_global_model_trains_and_returns_bf16(tmp_path: Path, case: Case) -> None:
    runner.run_round(_spec("init", case), tmp_path)
    init, _ = codec.decode((tmp_path / WEIGHTS_OUT).read_bytes())
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in init.items()}
    weights.write_weights(tmp_path / WEIGHTS_IN, bf16)
    result = runner.run_round(_spec("train", case), tmp_path)
    out, meta = codec.decode((tmp_path / WEIGHTS_OUT).read_bytes())
    assert codec.spec(out) == codec.spec(bf16)
    assert meta == {"task": case.task_name, "round": "2"}
    assert result.num_examples > 0 and result.eval_metrics["accuracy"] < 0.5


def test_init_is_deterministic_given_the_seed(tmp_path: Path, case: Case) -> None:
    outs = []
    for i, seed in enumerate((5, 5, 6)):
        workdir = tmp_path / str(i)
        workdir.mkdir()
        runner.run_round(_spec("init", case, seed), workdir)
        outs.append((workdir / WEIGHTS_OUT).read_bytes())
    assert outs[0] == outs[1] != outs[2]


def test_training_is_deterministic_given_the_seed(tmp_path: Path, case: Case) -> None:
    _init(case, tmp_path)
    outs = []
    for seed in (3, 3, 4):
        runner.run_round(_spec("train", case, seed), tmp_path)
        outs.append((tmp_path / WEIGHTS_OUT).read_bytes())
    assert outs[0] == outs[1] != outs[2]


def test_a_train_round_learns_and_reports_its_metrics(tmp_path: Path, case: Case) -> None:
    _init(case, tmp_path)
    first = runner.run_round(_spec("train", case, local_epochs=3), tmp_path)
    (tmp_path / WEIGHTS_OUT).rename(tmp_path / WEIGHTS_IN)
    after = runner.run_round(_spec("evaluate", case), tmp_path)
    assert {"loss", "accuracy"} <= set(first.train_metrics)
    # The held-out score of the weights that round wrote, against the untrained model's.
    assert after.eval_metrics["accuracy"] > first.eval_metrics["accuracy"] + 0.3
    assert after.num_eval_examples == first.num_eval_examples > 0
    assert first.num_examples > 0 and first.train_seconds > 0
    assert not (tmp_path / WEIGHTS_OUT).exists()  # evaluate sends no weights


def test_weights_of_another_model_are_refused(tmp_path: Path, case: Case) -> None:
    weights.write_weights(tmp_path / WEIGHTS_IN, {"fc.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(weights.WeightsError,
                       match="received weights do not match the task's model: missing "):
        runner.run_round(_spec("evaluate", case), tmp_path)


def test_divergence_is_reported_not_shipped(tmp_path: Path, case: Case) -> None:
    _init(case, tmp_path)
    with pytest.raises(runner.DivergedError, match="lower 'lr'") as info:
        runner.run_round(_spec("train", case, lr=1e12), tmp_path)
    assert runner.classify(info.value).kind == "exception"
    assert not (tmp_path / WEIGHTS_OUT).exists()


@pytest.mark.parametrize("switches", [{"amp": "bf16"}, {"channels_last": True},
                                      {"amp": "fp16", "cudnn_benchmark": True}])
def test_gpu_switches_apply_to_either_contract_on_the_cpu(
    tmp_path: Path, case: Case, switches: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The runner takes its switches out of the task's hyperparameters (digits would refuse
    them as unknown) and runs the round; what cannot apply on the CPU is logged, not fatal."""
    _init(case, tmp_path)
    with caplog.at_level("INFO", logger="fedgpu.worker"):
        result = runner.run_round(_spec("train", case, **switches), tmp_path)
    assert result.num_examples > 0 and np.isfinite(result.train_metrics["loss"])
    out, _ = codec.decode((tmp_path / WEIGHTS_OUT).read_bytes())
    # Whatever the layout in training, the wire gets row-major tensors.
    assert all(arr.flags["C_CONTIGUOUS"] for arr in out.values())
    if switches.get("amp") == "fp16":
        assert "amp=fp16 ignored on cpu" in caplog.text
        assert "cudnn_benchmark ignored on cpu" in caplog.text


def test_a_bad_switch_value_is_bad_input(tmp_path: Path, case: Case) -> None:
    _init(case, tmp_path)
    with pytest.raises(HyperparameterError, match="amp must be one of bf16, fp16, off") as info:
        runner.run_round(_spec("train", case, amp="fp8"), tmp_path)
    assert runner.classify(info.value).kind == "bad_input"
