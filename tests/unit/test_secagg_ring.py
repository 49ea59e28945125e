"""`ring_bits = "auto"`: the masked sums live in Z_2^32 exactly when the round's largest possible
sum fits there, with the weight bound taken from the sites' stated training-set sizes, and in
Z_2^64 otherwise; in both, the most extreme inputs the sites can send (every value at +-clip,
weights above the bound) sum without wrapping around, and the protocol end to end on a 32-bit
ring is weighted FedAvg within the stated quantisation bound."""

from __future__ import annotations

import numpy as np
import pytest

from fedgpu.core.secagg.errors import SecAggError, Stage
from fedgpu.core.secagg.local import run_local
from fedgpu.core.secagg.params import RoundParams, Settings, weight_bound
from fedgpu.core.secagg.quantize import decode_sum, encode, error_bound, levels, site_weight

F32 = 6e-8


def test_the_weight_bound_is_the_power_of_two_above_the_largest_stated_size() -> None:
    assert weight_bound(1 << 24, [60, 99, 10]) == 128
    assert weight_bound(1 << 24, [128, 3]) == 128
    assert weight_bound(1 << 24, [129]) == 256
    assert weight_bound(100, [60, 99]) == 100  # the job's max_weight stays the ceiling
    assert weight_bound(1 << 24, [60, 0]) == 1 << 24  # a site that stated nothing: unknown
    assert weight_bound(1 << 24, []) == 1 << 24


@pytest.mark.parametrize(("n", "stated", "ring"), [
    # 20 bits: L = 2^19 - 1. n x 128 x L < 2^31 up to n = 32.
    (10, 99, 32), (32, 128, 32), (33, 128, 64),
    # n = 10: the bound may be 256 (10 x 256 x L < 2^31) but not 512.
    (10, 256, 32), (10, 257, 64),
    # Nothing stated: max_weight 2^24 counts, and only Z_2^64 holds the sum.
    (10, 0, 64), (3, 0, 64),
    # A huge stated size, or many sites.
    (10, 10**9, 64), (5000, 10, 64),
])
def test_auto_picks_32_bits_when_the_sum_fits_and_64_when_not(n: int, stated: int,
                                                              ring: int) -> None:
    p = Settings().resolve(n, 100, [stated] * n)
    assert p.ring_bits == ring
    worst = n * p.max_weight * levels(p.bits)
    assert worst < 1 << (p.ring_bits - 1)
    if ring == 64:
        assert worst >= 1 << 31  # 32 bits were really too few


def test_a_ring_asked_for_by_number_is_kept_or_refused_not_changed() -> None:
    assert Settings(ring_bits=64).resolve(3, 100, [10] * 3).ring_bits == 64
    with pytest.raises(SecAggError, match="overflows Z_2\\^32.*ring_bits = 64"):
        Settings(ring_bits=32).resolve(10, 100)
    with pytest.raises(SecAggError, match="overflows Z_2\\^64"):
        Settings(bits=62).resolve(10, 100)  # auto: not even 64 bits hold it


def test_a_site_cannot_be_sent_a_ring_too_small_for_its_round() -> None:
    p = Settings().resolve(10, 100, [99] * 10)
    forged = RoundParams(**{**p.__dict__, "max_weight": 1 << 20})
    with pytest.raises(SecAggError, match="overflows"):
        forged.check()


@pytest.mark.parametrize(("n", "stated"), [(32, 128), (10, 256), (33, 128), (10, 0)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_most_extreme_inputs_do_not_wrap_around(n: int, stated: int, sign: float) -> None:
    p = Settings(stochastic=False).resolve(n, 64, [stated] * n)
    dtype = np.dtype(f"<u{p.ring_bits // 8}")
    total = np.zeros(p.length + 1, dtype=dtype)
    for _ in range(n):
        # Beyond clip, and a weight far above the bound: the site clips and caps both.
        x = np.full(p.length, 5.0 * sign, dtype=np.float32)
        w = site_weight(10.0**12, p.max_weight)
        total += encode(x, w, p.clip, p.bits, p.ring_bits, None)
    mean, weight = decode_sum(total, p.clip, p.bits)
    assert weight == n * p.max_weight
    np.testing.assert_allclose(mean, sign * p.clip, atol=F32)


def test_protocol_on_the_32_bit_ring_is_weighted_fedavg_with_dropouts() -> None:
    rng = np.random.default_rng(7)
    k = 10
    updates = [rng.uniform(-0.5, 0.5, 2000).astype(np.float32) for _ in range(k)]
    weights = [float(w) for w in rng.integers(1, 100, k)]
    settings = Settings()
    out, agg = run_local(updates, weights, settings, drop={Stage.MASKED_INPUT: {2, 3}},
                         stated=[99] * k)
    assert (agg.params.ring_bits, agg.params.max_weight) == (32, 128)
    counted = [i for i in range(k) if i + 1 not in (2, 3)]
    total = sum(weights[i] for i in counted)
    ref = sum(weights[i] * updates[i].astype(np.float64) for i in counted) / total
    assert out.total_weight == total
    assert np.abs(out.mean - ref).max() <= error_bound(settings.clip, settings.bits, True) + F32
    assert out.report.recovered == 2
