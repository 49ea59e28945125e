"""Distributed DP ([privacy] mode = "distributed"): each site's clip and noise share
(fedgpu/core/secagg/noise_share.py) inside the real secure-aggregation sessions, and the
aggregator's account (server/strategies/private.py), which adds no noise of its own."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedgpu.core.privacy import BUDGET_SPENT_REASON, parse_privacy
from fedgpu.core.privacy.accountant import RoundEvent, epsilon_of
from fedgpu.core.secagg import site as site_module
from fedgpu.core.secagg.errors import BelowThreshold, SecAggError
from fedgpu.core.secagg.local import run_local
from fedgpu.core.secagg.noise_share import (
    RANGE_SIGMAS,
    NoiseShare,
    add_share,
    csprng,
    private_spans,
)
from fedgpu.core.secagg.params import Settings
from fedgpu.core.secagg.quantize import decode_sum, error_bound
from fedgpu.node.secagg import noise_share_of
from fedgpu.proto import pb
from fedgpu.server.strategies import make_strategy
from fedgpu.server.strategies.private import PrivateStrategy
from fedgpu.server.strategies.update import UpdateIn

Z, C = 1.5, 0.5


def test_shares_of_n_min_sites_sum_to_noise_of_variance_z2_c2() -> None:
    # The statistical test of the mechanism: K = n_min sites' shares (of a zero update, so the
    # sum is the noise alone) sum to N(0, z^2 C^2) per value; more sites only add variance.
    share = NoiseShare(C, Z)
    rng = np.random.default_rng(7)
    d, n_min = 200_000, 4
    shares = [add_share(np.zeros(d, np.float32), share, n_min, 100.0, rng=rng)[0]
              for _ in range(6)]
    total = np.sum(shares[:n_min], axis=0, dtype=np.float64)
    # The sample variance of 200000 values is within 1% of the truth (its std is 0.3%).
    assert total.var() == pytest.approx(Z ** 2 * C ** 2, rel=0.01)
    assert abs(total.mean()) < 0.01
    assert shares[0].var() == pytest.approx(Z ** 2 * C ** 2 / n_min, rel=0.01)
    # Six survivors of a round made for n_min = 4: variance 6/4 z^2 C^2, never less.
    six = np.sum(shares, axis=0, dtype=np.float64)
    assert six.var() == pytest.approx(6 / 4 * Z ** 2 * C ** 2, rel=0.01)


def test_a_site_clips_the_float_values_and_zeroes_the_integer_ones() -> None:
    model = {"b": np.zeros(3, np.float32), "steps": np.array(5, np.int64),
             "w": np.zeros((4, 5), np.float32)}
    spans = private_spans(model)
    # Sorted names: b [0, 3), steps [3, 4) (an integer, left out), w [4, 24).
    assert spans == ((0, 3), (4, 24))
    change = np.full(24, 10.0, np.float32)
    out, report = add_share(change, NoiseShare(1.0, 0.0), 2, 5.0, spans)
    assert out[3] == 0.0  # the step counter's change is no part of the update: kept global
    assert np.linalg.norm(out) <= 1.0 and np.linalg.norm(out) > 0.999
    assert np.allclose(out[[0, 1, 2, *range(4, 24)]], out[0])  # the direction is kept
    assert report.clipped and report.norm == pytest.approx(10.0 * math.sqrt(23))
    assert report.std == 0.0 and report.cut == 0
    assert np.all(change == 10.0)  # the caller's vector is untouched
    small = np.full(24, 0.01, np.float32)
    kept, report = add_share(small, NoiseShare(1.0, 0.0), 2, 5.0, spans)
    assert not report.clipped and np.allclose(kept[[0, 5]], 0.01)


def test_the_noise_is_fresh_from_the_os_never_replayable() -> None:
    a = add_share(np.zeros(1000, np.float32), NoiseShare(1.0, 1.0), 2, 10.0)[0]
    b = add_share(np.zeros(1000, np.float32), NoiseShare(1.0, 1.0), 2, 10.0)[0]
    assert not np.array_equal(a, b)
    assert csprng().integers(1 << 62) != csprng().integers(1 << 62)


def test_no_site_masks_an_unclipped_update(monkeypatch: pytest.MonkeyPatch) -> None:
    # Instrument the site: what it quantises and masks (the masked input before its masks)
    # decodes to a vector of norm <= C + the norm of its noise, and weight 1, whatever the
    # update's size and the examples the site claims.
    captured: list[np.ndarray] = []
    real_encode = site_module.encode

    def spy(update: np.ndarray, weight: int, *args: object) -> np.ndarray:
        out = real_encode(update, weight, *args)  # type: ignore[arg-type]
        captured.append(out.copy())
        return out

    monkeypatch.setattr(site_module, "encode", spy)
    k, d = 5, 20_000
    rng = np.random.default_rng(3)
    updates = [rng.standard_normal(d).astype(np.float32) * s for s in (0.01, 1, 5, 20, 100)]
    share = NoiseShare(C, Z)
    settings = Settings(clip=8.0)  # threshold 0.5 of 5 holders: n_min = 3
    out, agg = run_local(updates, [10, 100, 1000, 5000, 100_000], settings, noise=share)
    n_min = agg.params.threshold
    assert n_min == 3
    std = share.std(n_min)
    assert len(captured) == k
    quant = error_bound(settings.clip, settings.bits, True) * math.sqrt(d)
    # ||noise|| of d values with std s is s sqrt(d) within a few s (chi concentration).
    bound = C + std * (math.sqrt(d) + 6) + quant
    for vec in captured:
        values, weight = decode_sum(vec, settings.clip, settings.bits)
        assert weight == 1
        assert np.linalg.norm(values.astype(np.float64)) <= bound
    # The unmasked mean: the clipped updates' mean plus noise of std sqrt(m / n_min) z C / m.
    assert out.total_weight == k
    clipped = [u * min(1.0, C / np.linalg.norm(u.astype(np.float64))) for u in updates]
    noise = out.mean.astype(np.float64) - np.mean(clipped, axis=0)
    assert noise.std() == pytest.approx(math.sqrt(k / n_min) * Z * C / k, rel=0.03)


def test_a_range_that_would_cut_the_noise_is_refused_by_every_site() -> None:
    share = NoiseShare(C, Z)
    assert share.range_problem(C + RANGE_SIGMAS * share.std(3), 3) is None
    why = share.range_problem(1.0, 3)
    assert why is not None and "set [secure_aggregation] clip to at least" in why
    updates = [np.zeros(100, np.float32)] * 3
    # Each site checks the Setup's numbers itself and drops out instead of masking.
    with pytest.raises(BelowThreshold):
        run_local(updates, [1, 1, 1], Settings(clip=1.0), noise=share)


def test_the_task_header_carries_the_share_settings() -> None:
    assert noise_share_of(pb.TaskHeader()) is None
    header = pb.TaskHeader(privacy_distributed=pb.PrivacyDistributedDp(
        clip_norm=0.7, noise_multiplier=1.1))
    assert noise_share_of(header) == NoiseShare(0.7, 1.1)
    with pytest.raises(SecAggError, match="clip_norm must be a positive number"):
        noise_share_of(pb.TaskHeader(privacy_distributed=pb.PrivacyDistributedDp(
            clip_norm=0.0, noise_multiplier=1.0)))


def _distributed(**table: object) -> PrivateStrategy:
    settings = parse_privacy({"mode": "distributed", **table}, secure_aggregation=True)
    out = make_strategy("fedavg", {}, settings, 10)
    assert isinstance(out, PrivateStrategy)
    return out


def test_the_aggregator_adds_no_noise_and_accounts_z_per_round() -> None:
    s = _distributed(clip_norm=C, noise_multiplier=Z, target_epsilon=4.0)
    g = {"w": np.zeros(1000, np.float32)}
    unmasked = {"w": np.full(1000, 0.25, np.float32)}
    s.begin_round(g)
    s.add(UpdateIn(unmasked, 4))  # the secure plan's one update: global + the unmasked mean
    s.secure_sum(3, 4)
    new = s.finish()
    s.commit()
    assert np.array_equal(new["w"], unmasked["w"])  # nothing added on the aggregator
    report = s.round_report()
    assert report is not None
    assert report["epsilon"] == pytest.approx(epsilon_of([RoundEvent(1.0, Z)], 1e-5), abs=1e-5)
    assert (report["mode"], report["updates"], report["min_sites"]) == ("distributed", 4, 3)
    assert report["share_std"] == pytest.approx(Z * C / math.sqrt(3))
    assert report["noise_std"] == pytest.approx(math.sqrt(4 / 3) * Z * C / 4)
    with pytest.raises(ValueError, match="fewer than n_min"):
        s.secure_sum(3, 2)
    # The budget stops the job as in central mode, with the same multiplier.
    while s.exhausted() is None:
        s.begin_round(g)
        s.add(UpdateIn(unmasked, 3))
        s.secure_sum(3, 3)
        s.finish()
        s.commit()
    assert s.exhausted().startswith(BUDGET_SPENT_REASON)
    assert s.spent() <= 4.0 < epsilon_of([RoundEvent(1.0, Z)] * (s.accountant.rounds + 1), 1e-5)


def test_noise_derived_from_the_budget_is_the_central_one() -> None:
    central = make_strategy("fedavg", {}, parse_privacy(
        {"mode": "central", "clip_norm": 1.0, "target_epsilon": 3.0}), 10)
    distributed = _distributed(clip_norm=1.0, target_epsilon=3.0)
    assert isinstance(central, PrivateStrategy)
    assert distributed.noise_multiplier == pytest.approx(central.noise_multiplier)
    assert distributed.accounted_multiplier == distributed.noise_multiplier
