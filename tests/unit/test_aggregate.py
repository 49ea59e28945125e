"""FedAvg arithmetic against a direct numpy computation."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.server.strategies import make_strategy
from fedgpu.server.strategies.aggregate import WeightedSum, weighted_mean, weighted_metric
from fedgpu.server.strategies.update import UpdateIn

RNG = np.random.default_rng(1)


def model(scale: float = 1.0) -> dict[str, np.ndarray]:
    return {
        "conv.w": (RNG.standard_normal((4, 3, 3, 3)) * scale).astype(np.float32),
        "fc.b": (RNG.standard_normal(10) * scale).astype(np.float32),
        "half": (RNG.standard_normal(6) * scale).astype(np.float16),
        "steps": np.array(RNG.integers(0, 100), dtype=np.int64),
        "empty": np.zeros((0,), np.float32),
    }


def direct(updates: list[tuple[dict[str, np.ndarray], float]]) -> dict[str, np.ndarray]:
    total = sum(w for _, w in updates)
    return {
        k: sum(u[k].astype(np.float64) * w for u, w in updates) / total
        for k in updates[0][0]
    }


@pytest.mark.parametrize("k", [1, 2, 7])
def test_weighted_fedavg_matches_numpy(k: int) -> None:
    updates = [(model(), float(RNG.integers(1, 500))) for _ in range(k)]
    got = weighted_mean(updates)
    want = direct(updates)
    for name, arr in got.items():
        assert arr.dtype == updates[0][0][name].dtype and arr.shape == want[name].shape
        tol = 1e-2 if arr.dtype == np.float16 else 1e-5
        if arr.dtype.kind == "i":
            assert arr == np.rint(want[name])
        else:
            np.testing.assert_allclose(arr, want[name], rtol=tol, atol=tol)


def test_weights_matter() -> None:
    a = {"w": np.zeros(3, np.float32)}
    b = {"w": np.ones(3, np.float32)}
    np.testing.assert_allclose(weighted_mean([(a, 1), (b, 3)])["w"], 0.75)
    np.testing.assert_allclose(weighted_mean([(a, 3), (b, 1)])["w"], 0.25)


def test_bfloat16_is_averaged_in_float32() -> None:
    a = {"w": np.full(4, 1.0, ml_dtypes.bfloat16)}
    b = {"w": np.full(4, 2.0, ml_dtypes.bfloat16)}
    out = weighted_mean([(a, 1), (b, 1)])["w"]
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out.astype(np.float32), 1.5)


def test_streaming_sum_uses_constant_memory() -> None:
    like = {"w": np.zeros(1000, np.float32)}
    acc = WeightedSum(like)
    buffers = len(acc._acc) + len(acc._scratch)
    for _ in range(50):
        acc.add({"w": RNG.standard_normal(1000).astype(np.float32)}, 2.0)
    assert len(acc._acc) + len(acc._scratch) == buffers and acc.count == 50


@pytest.mark.parametrize("block", [7, 1 << 18])
def test_blocked_sum_streamed_or_batched_matches_numpy(block: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Block edges (a block of 7 never divides the tensors) and the first-update shortcut
    # (the sum starts uninitialised) are where a blocked sum goes wrong.
    monkeypatch.setattr("fedgpu.server.strategies.aggregate.BLOCK", block)
    updates = [(model(), float(RNG.integers(1, 50))) for _ in range(5)]
    want = direct(updates)
    streamed = WeightedSum(updates[0][0])
    for tensors, w in updates:
        streamed.add(tensors, w)
    batched = WeightedSum(updates[0][0])
    batched.add_many(updates[:2])
    batched.add_many(updates[2:])
    for got in (streamed.mean(), batched.mean()):
        np.testing.assert_allclose(got["conv.w"], want["conv.w"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["half"], want["half"], rtol=1e-2, atol=1e-2)


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="positive"):
        WeightedSum({"w": np.zeros(2)}).add({"w": np.zeros(2)}, 0)
    with pytest.raises(ValueError, match="no updates"):
        WeightedSum({"w": np.zeros(2)}).mean()
    with pytest.raises(ConfigError, match="unknown strategy"):
        make_strategy("fedmagic")


def test_fedavg_strategy_rounds() -> None:
    s = make_strategy("fedavg")
    g = model()
    s.begin_round(g)
    u1, u2 = model(), model()
    s.add(UpdateIn(u1, 10))
    s.add(UpdateIn(u2, 30))
    out = s.finish()
    np.testing.assert_allclose(out["fc.b"], (u1["fc.b"] * 10 + u2["fc.b"] * 30) / 40, rtol=1e-5)


def test_weighted_metric() -> None:
    assert weighted_metric([(1.0, 1), (0.0, 3)]) == 0.25
    assert weighted_metric([]) is None


def test_no_finite_update_overflows_the_weighted_mean() -> None:
    # The case: 1e24 with 1e15 examples is 1e39 as a weighted sum, inf in float32.
    big = {"w": np.full(5, 1e24, np.float32)}
    small = {"w": np.full(5, 1.0, np.float32)}
    out = weighted_mean([(small, 1.0), (big, 1e15), (small, 3.0)])["w"]
    want = (1e24 * 1e15 + 4.0) / (1e15 + 4.0)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=1e-6)
    # At the very top of float32, with any weights, the mean stays there.
    top = np.finfo(np.float32).max
    edge = {"w": np.array([top, -top, top], np.float32)}
    acc = WeightedSum(edge)
    for w in (1.0, 1e18, 3.0, 1e-3):
        acc.add(edge, w)
    np.testing.assert_array_equal(acc.mean()["w"], edge["w"])
    with pytest.raises(ValueError, match="positive and finite"):
        WeightedSum(edge).add(edge, float("inf"))


def test_robust_statistics_of_huge_values_stay_finite() -> None:
    from fedgpu.server.strategies.aggregate import coordinate_median, trimmed_mean

    top = np.finfo(np.float32).max
    block = np.array([[top], [top], [top], [top]], np.float32)
    assert np.isfinite(coordinate_median(block.copy())).all()
    assert coordinate_median(block.copy())[0] == top
    assert np.isfinite(trimmed_mean(block.copy(), 0.0)).all()
    wide = np.array([[1e308], [1e308], [1e308]])
    np.testing.assert_allclose(trimmed_mean(wide, 0.0), [1e308])


def test_server_optimiser_state_changes_only_when_the_round_is_kept() -> None:
    s = make_strategy("fedadam", {"eta": 0.1})
    g = {"w": np.zeros(3, np.float32)}
    s.begin_round(g)
    s.add(UpdateIn({"w": np.ones(3, np.float32)}, 1))
    s.finish()
    s.commit()
    kept = {k: v.copy() for k, v in s.tensor_state().items()}
    # A round whose deltas square to inf in float32: the proposal is flagged and dropped.
    s.begin_round(g)
    s.add(UpdateIn({"w": np.full(3, 1e20, np.float32)}, 1))
    s.finish()
    assert s.pending_problem() == "optimiser state v/w is not finite"
    s.begin_round(g)  # the retry starts from the kept moments
    assert all(np.array_equal(kept[k], v) for k, v in s.tensor_state().items())
    assert s.state() == {"steps": 1}
