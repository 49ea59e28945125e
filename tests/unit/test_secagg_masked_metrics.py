"""The sites' training numbers inside the masked vector (fedgpu/core/secagg/masked_metrics.py).

Threat model: under secure aggregation the aggregator must learn a site's loss, examples,
steps and examples per second only as part of the round's sums. These tests run the real
protocol (every message through its byte encoding) and check that the sums come out exact
through dropouts, that no element of a masked input shows the plain number, that the encoding
cannot overflow even a 32-bit ring at the largest round, and that distributed DP sends none.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedgpu.core.secagg import masked_metrics
from fedgpu.core.secagg.errors import SecAggError, Stage
from fedgpu.core.secagg.local import run_local
from fedgpu.core.secagg.messages import MaskedInput, Setup
from fedgpu.core.secagg.noise_share import NoiseShare
from fedgpu.core.secagg.params import MAX_SITES, Settings

METRICS = [
    {"loss": 2.5, "examples": 10.0, "steps": 3.0, "examples_per_s": 120.25},
    {"loss": 0.5, "examples": 30.0, "steps": 5.0, "examples_per_s": 80.5},
    {"loss": 1.25, "examples": 60.0, "steps": 8.0, "examples_per_s": 40.125},
    {"loss": 9.0, "examples": 99.0, "steps": 1.0, "examples_per_s": 1.0},
    {"loss": 1.0, "examples": 7.0, "steps": 2.0, "examples_per_s": 10.0},
]


def _updates(n: int, length: int = 50) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.uniform(-0.1, 0.1, length).astype(np.float32) for _ in range(n)]


def test_sums_are_exact_through_dropouts_and_nothing_per_site_is_in_the_clear() -> None:
    weights = [10, 30, 60, 99, 7]
    seen: dict[int, np.ndarray] = {}

    def observe(stage: Stage, index: int, data: bytes) -> None:
        if stage == Stage.MASKED_INPUT:
            seen[index] = MaskedInput.decode(data).vector.copy()

    # Site 4 drops before masking; site 2 masks, then drops at unmasking (its input stays).
    out, agg = run_local(_updates(5), weights, Settings(), drop={
        Stage.MASKED_INPUT: {4}, Stage.UNMASK: {2}}, observe=observe, seed=3,
        metrics=METRICS, stated=[100] * 5)
    assert agg.params.ring_bits == 32 and agg.params.metrics == masked_metrics.SLOTS
    m = out.metrics
    assert m["loss"]["value"] == pytest.approx((10 * 2.5 + 30 * 0.5 + 60 * 1.25 + 7) / 107,
                                               abs=1e-6)
    assert m["examples"] == {"value": 107, "sites": 4}
    assert m["steps"] == {"value": 18, "sites": 4}
    assert m["examples_per_s"]["value"] == pytest.approx(250.875, abs=1e-3)
    assert out.total_weight == 107
    # What the aggregator held of each site: the metric elements are masked like the rest.
    for i, vector in seen.items():
        plain = masked_metrics.encode(METRICS[i - 1], weights[i - 1], vector.dtype)
        tail = vector[-masked_metrics.SLOTS:]
        assert np.count_nonzero(tail == plain) <= 1, (i, tail, plain)


def test_missing_negative_and_non_finite_numbers() -> None:
    metrics = [{"loss": -0.75, "examples": 4.0}, {"loss": float("nan"), "steps": 2.0},
               {"examples": 6.0}]
    out, _ = run_local(_updates(3), [4, 5, 6], Settings(), metrics=metrics, seed=0)
    m = out.metrics
    # A negative loss sums as one; a NaN loss counts as not reported (its weight too).
    assert m["loss"] == {"value": pytest.approx(-0.75, abs=1e-6), "sites": 1}
    assert m["examples"] == {"value": 10, "sites": 2}
    assert m["steps"] == {"value": 2, "sites": 1}
    assert "examples_per_s" not in m


def test_the_largest_round_cannot_overflow_a_32_bit_ring() -> None:
    # Every site at the clamp: the element sums of MAX_SITES sites still fit Z_2^32, and the
    # recombined totals are exact.
    huge = {"loss": 1e30, "examples": 2.0**70, "steps": -(2.0**70), "examples_per_s": 1e30}
    one = masked_metrics.encode(huge, 1 << 24, np.dtype(np.uint64))
    total = one * np.uint64(MAX_SITES)
    assert int(total.max()) < 1 << 32
    m = masked_metrics.decode(total.astype(np.uint32))
    limit = (1 << 63) - 1
    assert m["examples"]["value"] == MAX_SITES * limit
    assert m["steps"]["value"] == -MAX_SITES * limit
    assert m["loss"]["sites"] == MAX_SITES


EVAL = [{"eval_loss": 0.5 + i, "eval_accuracy": 0.25 * i, "num_eval_examples": 10.0 * i}
        for i in range(1, 6)]


def test_the_evaluation_is_weighted_by_held_out_examples() -> None:
    metrics = [{**m, **e} for m, e in zip(METRICS, EVAL, strict=True)]
    out, _ = run_local(_updates(5), [10, 30, 60, 99, 7], Settings(), metrics=metrics, seed=0)
    m = out.metrics
    assert m["num_eval_examples"] == {"value": 150, "sites": 5}
    # sum(n_i x score_i) / sum(n_i), n_i = 10 i.
    assert m["eval_loss"]["value"] == pytest.approx(
        sum(10 * i * (0.5 + i) for i in range(1, 6)) / 150, abs=1e-6)
    assert m["eval_accuracy"]["value"] == pytest.approx(
        sum(10 * i * 0.25 * i for i in range(1, 6)) / 150, abs=1e-6)


def test_distributed_dp_sends_the_evaluation_only() -> None:
    # A sum of the sites' un-noised training numbers would escape the privacy account: a site
    # with a noise share sends none of them even if asked; its held-out evaluation goes.
    metrics = [{**m, **e} for m, e in zip(METRICS, EVAL, strict=True)]
    out, agg = run_local(_updates(5), [1] * 5, Settings(clip=8.0), metrics=metrics,
                         noise=NoiseShare(1.0, 1.0), seed=0)
    assert agg.params.metrics == masked_metrics.SLOTS
    assert set(out.metrics) == {"eval_loss", "eval_accuracy", "num_eval_examples"}


def test_a_setup_with_another_metrics_size_is_refused() -> None:
    params = Settings().resolve(3, 10, metrics=True)
    good = Setup(b"c" * 32, 1, b"g" * 32, params).encode()
    assert Setup.decode(good).params.metrics == masked_metrics.SLOTS
    bad = Setup(b"c" * 32, 1, b"g" * 32, params.__class__(**{**params.__dict__,
                                                              "metrics": 3})).encode()
    with pytest.raises(SecAggError, match="masked metrics take 0 or"):
        Setup.decode(bad)
    with pytest.raises(SecAggError, match="expected"):
        masked_metrics.decode(np.zeros(3, np.uint32))
