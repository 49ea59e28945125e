"""WeightedSum's fast path (fixed reference weight, no per-update rescale or clip) and its exact
fallback: the fast path must be taken on ordinary updates and must never overflow on huge ones."""

from __future__ import annotations

import numpy as np
import pytest

from fedgpu.server.rejections import UpdateRejected
from fedgpu.server.rounds.validation import check_finite, finite_norms
from fedgpu.server.strategies.aggregate import Normed, WeightedSum, weighted_mean

RNG = np.random.default_rng(7)
TOP = float(np.finfo(np.float32).max)


def update(n: int = 1000, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {"a": (RNG.standard_normal(n) * scale).astype(np.float32),
            "b": (RNG.standard_normal((3, 5)) * scale).astype(np.float32)}


def exact(updates: list[tuple[dict[str, np.ndarray], float]]) -> dict[str, np.ndarray]:
    total = sum(w for _, w in updates)
    return {k: sum(u[k].astype(np.float64) * (w / total) for u, w in updates)
            for k in updates[0][0]}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Blocks of 64 elements: several per tensor, a partial one at each tensor's end.
    monkeypatch.setattr("fedgpu.server.strategies.aggregate.BLOCK", 64)


@pytest.mark.parametrize("normed", [False, True])
def test_ordinary_updates_take_the_fast_path_streamed_or_batched(normed: bool) -> None:
    ups = [(update(), float(w)) for w in (10, 17, 24, 31, 3)]
    if normed:
        ups = [(check_finite(u), w) for u, w in ups]
    want = exact(ups)
    streamed = WeightedSum(ups[0][0])
    for u, w in ups:
        streamed.add(u, w)
    batched = WeightedSum(ups[0][0])
    batched.add_many(ups[:3])
    batched.add_many(ups[3:])
    for acc in (streamed, batched):
        assert acc.exact_blocks == 0
        got = acc.mean()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_a_huge_update_mid_stream_turns_only_its_blocks_exact(normed: bool,
                                                              batched: bool) -> None:
    # Fast blocks first, then values near float32's top with a large weight: S would be
    # inf, the exact mean is finite. Only the blocks the huge values touch may go exact.
    ups = [(update(), 5.0), (update(), 7.0)]
    huge = update()
    huge["a"][100:130] = TOP / 2
    huge["a"][131] = -TOP
    ups += [(huge, 1e12), (update(), 3.0)]
    if normed:
        ups = [(check_finite(u), w) for u, w in ups]
    want = exact(ups)
    acc = WeightedSum(ups[0][0])
    if batched:
        acc.add(*ups[0])
        acc.add_many(ups[1:])
    else:
        for u, w in ups:
            acc.add(u, w)
    got = acc.mean()
    assert 0 < acc.exact_blocks
    if not normed:
        # Per-block checks: only the two blocks holding the huge values (elements 64..191).
        assert acc.exact_blocks == 2
    for k in want:
        assert np.isfinite(got[k]).all()
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)


def test_a_first_call_that_overflows_is_recomputed_exactly() -> None:
    edge = {"w": np.array([TOP, -TOP, TOP] * 30, np.float32)}
    out = weighted_mean([(edge, 1.0), (edge, 1e18), (edge, 3.0)])["w"]
    np.testing.assert_array_equal(out, edge["w"])


def test_mean_with_offset_adds_the_base_model() -> None:
    base = update()
    deltas = [(update(scale=0.1), 2.0), (update(scale=0.1), 6.0)]
    acc = WeightedSum(base)
    for d, w in deltas:
        acc.add(d, w)
    got = acc.mean(offset=base)
    want = exact(deltas)
    for k in base:
        np.testing.assert_allclose(got[k], base[k] + want[k], rtol=1e-5, atol=1e-6)


def test_finite_norms_measures_and_rejects() -> None:
    u = update()
    norms, bad = finite_norms(u)
    assert bad is None
    for k, v in u.items():
        assert norms[k] == pytest.approx(float(np.linalg.norm(v.astype(np.float64))), rel=1e-4)
    # Finite values whose squares overflow float32: not refused, norm unknown (inf).
    big = {"w": np.full(10, 1e30, np.float32)}
    norms, bad = finite_norms(big)
    assert bad is None and norms["w"] == float("inf")
    acc = WeightedSum(big)
    acc.add(Normed(big, norms), 1.0)
    acc.add(Normed(big, norms), 2.0)
    np.testing.assert_allclose(acc.mean()["w"], 1e30, rtol=1e-6)
    for poison in (np.inf, -np.inf, np.nan):
        v = update()
        v["b"][1, 2] = poison
        assert finite_norms(v)[1] == "b"
        with pytest.raises(UpdateRejected, match="'b' contains NaN or Inf"):
            check_finite(v)
