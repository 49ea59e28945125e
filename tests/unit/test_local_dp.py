"""Local DP on the node (node/rounds/local_dp.py): what the round's worker writes for upload is
the clipped and noised update, never the trained model itself."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.core.datasets import split_digits
from fedgpu.core.privacy.mechanisms import difference, l2_norm
from fedgpu.node.rounds import local_dp, runner
from fedgpu.node.rounds.workfiles import WEIGHTS_IN, WEIGHTS_OUT
from fedgpu.proto import pb


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split_digits(tmp_path_factory.mktemp("split"), 3, seed=1)[0]


def _raw(kind: str, data_dir: Path, privacy: dict[str, Any] | None = None,
         **hp: Any) -> dict[str, Any]:
    raw = {"kind": kind, "task_name": "digits", "hyperparameters": hp, "seed": 1, "round": 1,
           "data_dir": str(data_dir), "device": "cpu", "memory_fraction": None,
           "torch_threads": 1}
    if privacy is not None:
        raw["privacy"] = privacy
    return raw


def _trained_update(tmp_path: Path, digits_dir: Path, privacy: dict[str, Any] | None
                    ) -> tuple[dict[str, np.ndarray], runner.RoundResult]:
    global_ = codec.decode((tmp_path / WEIGHTS_IN).read_bytes())[0]
    result = runner.run_round(runner.parse_spec(_raw("train", digits_dir, privacy, lr=0.2,
                                                     local_epochs=2)), tmp_path)
    out = codec.decode((tmp_path / WEIGHTS_OUT).read_bytes())[0]
    assert codec.spec(out) == codec.spec(global_)
    return difference(out, global_), result


@pytest.fixture()
def initialised(tmp_path: Path, digits_dir: Path) -> Path:
    runner.run_round(runner.parse_spec(_raw("init", digits_dir)), tmp_path)
    (tmp_path / WEIGHTS_OUT).rename(tmp_path / WEIGHTS_IN)
    return tmp_path


def test_local_dp_never_writes_an_unclipped_update(initialised: Path, digits_dir: Path) -> None:
    plain, _ = _trained_update(initialised, digits_dir, None)
    assert l2_norm(plain) > 1.0  # what training alone would have uploaded
    for clip in (0.05, 0.5, 1.0):
        update, result = _trained_update(initialised, digits_dir,
                                         {"clip_norm": clip, "noise_multiplier": 0.0})
        assert l2_norm(update) <= clip * (1 + 1e-5)
        assert result.train_metrics["ldp_clipped"] == 1.0
        assert result.train_metrics["ldp_update_norm"] == pytest.approx(l2_norm(plain),
                                                                        rel=1e-3)


def test_local_dp_noise_is_added_to_the_clipped_update(initialised: Path,
                                                       digits_dir: Path) -> None:
    clip, z = 0.5, 0.2
    update, result = _trained_update(initialised, digits_dir,
                                     {"clip_norm": clip, "noise_multiplier": z})
    d = sum(a.size for a in update.values())
    # |clipped + noise|^2 = C^2 + 2<clipped, noise> + |noise|^2 ~ C^2 + d (zC)^2: far above C.
    expected = math.sqrt(clip**2 + d * (z * clip) ** 2)
    assert l2_norm(update) == pytest.approx(expected, rel=0.05)
    assert result.train_metrics["ldp_noise_std"] == pytest.approx(z * clip)


def test_privatize_keeps_dtypes_and_integer_tensors() -> None:
    rng = np.random.default_rng(0)
    g = {"w": rng.standard_normal(100).astype(np.float32), "n": np.array(5, np.int64)}
    trained = {"w": g["w"] + 10, "n": np.array(9, np.int64)}
    metrics: dict[str, float] = {}
    out = local_dp.privatize(trained, g, local_dp.LocalDp(1.0, 0.0), metrics)
    assert out["n"] == 5 and out["w"].dtype == np.float32  # the count is no part of it
    assert l2_norm(difference(out, g)) <= 1.0
    assert metrics["ldp_update_norm"] == pytest.approx(100.0, rel=1e-5)


def test_the_agent_writes_the_header_into_task_json() -> None:
    header = pb.TaskHeader(privacy_local=pb.PrivacyLocalDp(clip_norm=0.7, noise_multiplier=1.1))
    section = local_dp.from_header(header)
    assert local_dp.parse(section["privacy"]) == local_dp.LocalDp(0.7, 1.1)
    assert local_dp.from_header(pb.TaskHeader()) == {}


@pytest.mark.parametrize("bad", [{"clip_norm": 0, "noise_multiplier": 1},
                                 {"clip_norm": 1, "noise_multiplier": -1},
                                 {"clip_norm": 1}, "x"])
def test_a_bad_privacy_section_is_bad_input(bad: Any, digits_dir: Path) -> None:
    with pytest.raises(local_dp.LocalDpError) as info:
        runner.parse_spec(_raw("train", digits_dir, bad))
    assert runner.classify(info.value).kind == "bad_input"
