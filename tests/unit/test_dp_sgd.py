"""Example-level DP-SGD (node/rounds/dp_sgd.py): Opacus through the runner's options, on the
built-in digits (tensor) and images (Dataset) tasks, in-process like tests/unit/test_runner.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedgpu.core import codec
from fedgpu.core.datasets import split_digits
from fedgpu.core.synth_images import synth_images
from fedgpu.node.rounds import dp_sgd, runner
from fedgpu.node.rounds.workfiles import WEIGHTS_IN, WEIGHTS_OUT
from fedgpu.node.tasks import HyperparameterError

DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
_IMAGES_HP = {"depth": 8, "width": 8, "image_size": 16, "batch_size": 32}


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split_digits(tmp_path_factory.mktemp("split"), 3, seed=1)[0]


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_images(tmp_path_factory.mktemp("images"), 1, classes=10, per_class=20, size=16,
                        seed=1)[0]


def _spec(kind: str, task: str, data_dir: Path, device: str = "cpu", round_number: int = 2,
          **hp: Any) -> runner.RoundSpec:
    return runner.parse_spec({
        "kind": kind, "task_name": task, "hyperparameters": hp, "seed": 1,
        "round": round_number, "data_dir": str(data_dir), "device": device,
        "memory_fraction": None, "torch_threads": 1})


def _init(task: str, data_dir: Path, workdir: Path, device: str = "cpu", **hp: Any) -> None:
    runner.run_round(_spec("init", task, data_dir, device, **hp), workdir)
    (workdir / WEIGHTS_OUT).rename(workdir / WEIGHTS_IN)


@pytest.mark.parametrize("device", DEVICES)
def test_dp_sgd_round_on_digits_learns_and_reports_epsilon(tmp_path: Path, digits_dir: Path,
                                                           device: str) -> None:
    hp = {"dp_sgd": True, "noise_multiplier": 1.0, "max_grad_norm": 1.0, "local_epochs": 3,
          "lr": 0.1}
    _init("digits", digits_dir, tmp_path, device, **hp)
    result = runner.run_round(_spec("train", "digits", digits_dir, device, round_number=3,
                                    **hp), tmp_path)
    m = result.train_metrics
    assert m["dp_noise_multiplier"] == 1.0 and m["dp_delta"] == 1e-5
    # Poisson sampling at batch 32 over the node's ~480 examples: q = 1 / steps per epoch.
    steps_per_epoch = round(1 / m["dp_sample_rate"])
    assert m["dp_steps"] == 3 * steps_per_epoch
    # This round's epsilon is what Opacus's own accountant says for (z, q, steps).
    from opacus.accountants import RDPAccountant

    ref = RDPAccountant()
    ref.history = [(1.0, m["dp_sample_rate"], int(m["dp_steps"]))]
    assert m["dp_epsilon"] == pytest.approx(ref.get_epsilon(1e-5), rel=1e-4)
    # Round 3: three rounds of the same steps bound what this node spent in the job.
    ref.history = ref.history * 3
    assert m["dp_epsilon_total"] == pytest.approx(ref.get_epsilon(1e-5), rel=1e-4)
    assert 0 < m["dp_epsilon"] < m["dp_epsilon_total"] < 50
    (tmp_path / WEIGHTS_OUT).rename(tmp_path / WEIGHTS_IN)
    after = runner.run_round(_spec("evaluate", "digits", digits_dir, device), tmp_path)
    # Noisy, but learning: well above the 10% of chance.
    assert after.eval_metrics["accuracy"] > 0.4


def test_noise_derived_from_a_target_epsilon_spends_it(tmp_path: Path, digits_dir: Path) -> None:
    hp = {"dp_sgd": True, "dp_target_epsilon": 4.0, "dp_rounds": 5}
    _init("digits", digits_dir, tmp_path, **hp)
    m = runner.run_round(_spec("train", "digits", digits_dir, round_number=5, **hp),
                         tmp_path).train_metrics
    # Five rounds of these steps spend the target (Opacus calibrates within 0.01), not more.
    assert m["dp_epsilon_total"] == pytest.approx(4.0, abs=0.02)
    assert m["dp_epsilon_total"] <= 4.0 and m["dp_noise_multiplier"] > 0.3


def test_dp_sgd_noise_is_not_replayed_by_the_job_seed(tmp_path: Path, digits_dir: Path) -> None:
    hp = {"dp_sgd": True, "noise_multiplier": 1.0}
    _init("digits", digits_dir, tmp_path, **hp)
    outs = []
    for _ in range(2):
        runner.run_round(_spec("train", "digits", digits_dir, **hp), tmp_path)
        outs.append(codec.decode((tmp_path / WEIGHTS_OUT).read_bytes())[0])
    # Same seed, same data: without DP the two would be equal byte for byte.
    assert not np.array_equal(outs[0]["fc2.weight"], outs[1]["fc2.weight"])


def test_images_with_batchnorm_is_refused_with_opacus_reason(tmp_path: Path,
                                                             images_dir: Path) -> None:
    hp = {**_IMAGES_HP, "dp_sgd": True, "noise_multiplier": 1.0}
    # Refused in the initial model's round: the job fails at its start, with the reason.
    with pytest.raises(dp_sgd.DpModelError, match="BatchNorm") as info:
        runner.run_round(_spec("init", "images", images_dir, **hp), tmp_path)
    assert "dp_fix_model = true" in str(info.value)
    failure = runner.classify(info.value)
    assert failure.kind == "bad_input" and "Opacus cannot train this model" in failure.message


def test_images_trains_with_dp_after_opacus_fixes_the_model(tmp_path: Path,
                                                            images_dir: Path) -> None:
    hp = {**_IMAGES_HP, "dp_sgd": True, "noise_multiplier": 0.8, "dp_fix_model": True,
          "amp": "bf16", "max_steps": 4}
    _init("images", images_dir, tmp_path, **hp)
    init = codec.decode((tmp_path / WEIGHTS_IN).read_bytes())[0]
    # GroupNorm has no running statistics: the fixed model's tensors say so on the wire.
    assert not any(k.endswith("running_mean") for k in init)
    result = runner.run_round(_spec("train", "images", images_dir, **hp), tmp_path)
    m = result.train_metrics
    assert m["steps"] == 4 == m["dp_steps"] and m["dp_epsilon"] > 0
    assert np.isfinite(m["loss"])
    out = codec.decode((tmp_path / WEIGHTS_OUT).read_bytes())[0]
    assert codec.spec(out) == codec.spec(init)


@pytest.mark.parametrize("hp, words", [
    ({"noise_multiplier": 1.0}, "only apply with dp_sgd = true"),
    ({"dp_sgd": True}, "needs one of noise_multiplier"),
    ({"dp_sgd": True, "noise_multiplier": 1.0, "dp_target_epsilon": 3.0}, "not both"),
    ({"dp_sgd": True, "noise_multiplier": 1.0, "max_grad_norm": 0.0}, "max_grad_norm must be"),
    ({"dp_sgd": True, "noise_multiplier": 1.0, "dp_delta": 1.0}, "dp_delta must be"),
    ({"dp_sgd": True, "noise_multiplier": 1.0, "dp_accountant": "moments"}, "dp_accountant"),
    ({"dp_sgd": "yes"}, "dp_sgd must be true or false"),
])
def test_bad_dp_options_are_refused(hp: dict[str, Any], words: str) -> None:
    with pytest.raises(HyperparameterError, match=words):
        dp_sgd.split_dp("digits", hp)


def test_dp_keys_leave_the_rest_to_the_task() -> None:
    settings, rest = dp_sgd.split_dp("digits", {"dp_sgd": True, "noise_multiplier": 1.5,
                                                "lr": 0.1})
    assert rest == {"lr": 0.1}
    assert settings is not None and settings.noise_multiplier == 1.5
    assert dp_sgd.split_dp("digits", {"lr": 0.1}) == (None, {"lr": 0.1})


def test_empty_poisson_batches_still_take_their_step() -> None:
    """Batch size 1 over 3 rows: each batch is empty with probability (2/3)^3, so 15 steps
    almost surely include empty ones; each still steps (noise only) and counts."""
    from fedgpu.node.tasks.digits import DigitsTask

    class OneRow(DigitsTask):
        def batch_size(self, hparams: Any) -> int:
            return 1

    task = OneRow()
    model = task.build_model({})
    data = {"x_train": torch.randn(3, 1, 8, 8), "y_train": torch.tensor([1, 2, 3])}
    settings, _ = dp_sgd.split_dp("digits", {"dp_sgd": True, "noise_multiplier": 1.0})
    assert settings is not None
    private = dp_sgd.PrivateTraining("digits", settings, 1)
    n, m = dp_sgd.train_tensor_task(task, model, data, torch.device("cpu"),
                                    {"local_epochs": 5}, private)
    assert n == 3 and m["dp_steps"] == 15 and m["dp_sample_rate"] == pytest.approx(1 / 3)
    assert np.isfinite(m["loss"]) and all(torch.isfinite(p).all() for p in model.parameters())
