"""Client-level DP (fedgpu/core/privacy): the [privacy] table, clipping, noise, adaptive clipping
and the accountant against reference values of the libraries."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Job, parse_job
from fedgpu.core.privacy import BUDGET_SPENT_REASON, PrivacyMode, parse_privacy
from fedgpu.core.privacy.accountant import (
    Accountant,
    RoundEvent,
    epsilon_of,
    noise_for_budget,
)
from fedgpu.core.privacy.mechanisms import (
    AdaptiveClip,
    add_gaussian_noise,
    apply_update,
    clip,
    difference,
    l2_norm,
    noise_generator,
    update_noise_multiplier,
)

# ---- the [privacy] table --------------------------------------------------------------------


def test_privacy_table_parses_into_settings_on_the_job():
    job = parse_job({"task": "digits", "privacy": {
        "mode": "central", "clip_norm": 2, "noise_multiplier": 1.1, "target_epsilon": 8,
        "delta": 1e-6, "accountant": "pld"}})
    p = job.privacy
    assert p is not None and p.mode is PrivacyMode.CENTRAL
    assert (p.clip_norm, p.noise_multiplier, p.target_epsilon, p.delta, p.accountant) == (
        2.0, 1.1, 8.0, 1e-6, "pld")
    assert p.budgeted and not p.adaptive_clip
    assert parse_job({"task": "digits"}).privacy is None
    # A stored job (to_dict, Nones included) reads back to the same settings.
    assert parse_job(job.to_dict()) == job


def test_adaptive_clip_defaults_follow_andrew_et_al():
    p = parse_privacy({"mode": "central", "adaptive_clip": True, "noise_multiplier": 1.0})
    assert (p.clip_norm, p.target_quantile, p.clip_learning_rate) == (0.1, 0.5, 0.2)


@pytest.mark.parametrize("table, words", [
    ({}, "needs 'mode'"),
    ({"mode": "global", "clip_norm": 1, "noise_multiplier": 1}, "mode must be"),
    ({"mode": "central", "noise_multiplier": 1}, "needs 'clip_norm'"),
    ({"mode": "central", "clip_norm": 0, "noise_multiplier": 1}, "clip_norm must be"),
    ({"mode": "central", "clip_norm": True, "noise_multiplier": 1}, "clip_norm must be"),
    ({"mode": "central", "clip_norm": 1}, "needs 'noise_multiplier', or 'target_epsilon'"),
    ({"mode": "central", "clip_norm": 1, "noise_multiplier": -1}, "noise_multiplier must be"),
    ({"mode": "central", "clip_norm": 1, "noise_multiplier": math.inf}, "noise_multiplier"),
    ({"mode": "central", "clip_norm": 1, "noise_multiplier": 0, "target_epsilon": 3},
     "can never hold"),
    ({"mode": "central", "clip_norm": 1, "noise_multiplier": 1, "delta": 1}, "delta must be"),
    ({"mode": "central", "clip_norm": 1, "noise_multiplier": 1, "target_epsilon": -2},
     "target_epsilon must be"),
    ({"mode": "central", "clip_norm": 1, "noise_multiplier": 1, "accountant": "moments"},
     "accountant must be"),
    ({"mode": "central", "clip_norm": 1, "noise_multiplier": 1, "epsilon": 3},
     "unknown key(s) in [privacy]: epsilon"),
    ({"mode": "local", "adaptive_clip": True, "noise_multiplier": 1}, "needs mode = \"central\""),
    ({"mode": "central", "clip_norm": 1, "noise_multiplier": 1, "target_quantile": 0.9},
     "only applies with adaptive_clip"),
    ({"mode": "central", "adaptive_clip": True, "noise_multiplier": 1, "target_quantile": 1.5},
     "target_quantile must be"),
    ({"mode": "central", "adaptive_clip": True, "noise_multiplier": 2,
      "clipped_count_stddev": 1}, "more than noise_multiplier / 2"),
    ({"mode": "distributed", "clip_norm": 1, "noise_multiplier": 1}, "needs secure_aggregation"),
])
def test_bad_privacy_tables_are_refused_with_the_key(table, words):
    with pytest.raises(ConfigError) as info:
        parse_job({"task": "digits", "privacy": table}, "job.toml")
    assert words in str(info.value)
    assert str(info.value).startswith("job.toml: ")


def test_privacy_needs_an_averaging_star_job():
    table = {"mode": "central", "clip_norm": 1, "noise_multiplier": 1}
    with pytest.raises(ConfigError, match="needs a strategy that averages"):
        parse_job({"task": "digits", "strategy": "median", "privacy": table})
    with pytest.raises(ConfigError, match="in ring mode the nodes"):
        parse_job({"task": "digits", "mode": "ring", "min_nodes": 2, "iterations": 10,
                   "privacy": table})
    for strategy in ("fedavg", "fedavgm", "fedadam"):
        assert parse_job({"task": "digits", "strategy": strategy, "privacy": table}).privacy


def test_dp_sgd_target_covers_the_whole_job_unless_told_otherwise():
    hp = {"dp_sgd": True, "dp_target_epsilon": 8.0}
    assert parse_job({"task": "digits", "rounds": 7, "hyperparameters": hp}
                     ).hyperparameters["dp_rounds"] == 7
    given = parse_job({"task": "digits", "rounds": 7,
                       "hyperparameters": {**hp, "dp_rounds": 2}})
    assert given.hyperparameters["dp_rounds"] == 2 and parse_job(given.to_dict()) == given
    assert "dp_rounds" not in parse_job({"task": "digits", "hyperparameters": {
        "dp_sgd": True, "noise_multiplier": 1.0}}).hyperparameters


def test_privacy_must_be_a_table():
    with pytest.raises(ConfigError, match="must be a table"):
        parse_job({"task": "digits", "privacy": "central"})


# ---- clipping and noise ---------------------------------------------------------------------


def _model(rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {"w": (rng.standard_normal((64, 32)) * scale).astype(np.float32),
            "b": (rng.standard_normal(32) * scale).astype(np.float32),
            "steps": np.array(7, dtype=np.int64)}


def test_update_is_local_minus_global_over_float_tensors_only():
    rng = np.random.default_rng(0)
    g, local = _model(rng), _model(rng)
    up = difference(local, g)
    assert set(up) == {"w", "b"}  # the integer counter is no part of the private update
    np.testing.assert_allclose(up["w"], local["w"] - g["w"])
    back = apply_update(g, up)
    np.testing.assert_allclose(back["w"], local["w"], atol=1e-6)
    assert back["steps"] is g["steps"] and back["w"].dtype == np.float32
    with pytest.raises(ValueError, match="different tensors"):
        difference({"w": local["w"]}, g)


@pytest.mark.parametrize("scale", [1e-4, 0.3, 1.0, 50.0, 1e4])
@pytest.mark.parametrize("clip_norm", [0.01, 1.0, 10.0])
def test_clipping_bounds_every_update_norm(scale, clip_norm):
    rng = np.random.default_rng(int(scale * 1000) + int(clip_norm * 100))
    up = difference(_model(rng, scale), _model(rng, scale))
    before = l2_norm(up)
    out = clip(up, clip_norm)
    after = l2_norm(out.update)
    assert out.norm == pytest.approx(before)
    assert after <= clip_norm
    if before > clip_norm:
        assert out.was_clipped and after == pytest.approx(clip_norm, rel=1e-5)
        # One factor for the whole update: the direction is kept.
        cos = sum(float(np.dot(up[k].ravel(), out.update[k].ravel())) for k in up)
        assert cos / (before * after) == pytest.approx(1.0, rel=1e-5)
    else:
        assert not out.was_clipped and after == pytest.approx(before)


def test_clip_refuses_non_finite_updates_and_bad_clips():
    with pytest.raises(ValueError, match="NaN"):
        clip({"w": np.array([np.nan, 1.0], dtype=np.float32)}, 1.0)
    with pytest.raises(ValueError, match="positive"):
        clip({"w": np.ones(3, dtype=np.float32)}, 0.0)


def test_norm_of_a_known_update():
    assert l2_norm({"a": np.array([3.0], np.float32), "b": np.array([[4.0]], np.float32)}) == 5.0


def test_noise_has_the_stated_standard_deviation():
    # 2 x 10^5 draws: the sample std is within 1% of the truth with overwhelming probability
    # (its relative standard error is 1/sqrt(2n) = 0.16%); mean within 5 standard errors of 0.
    n, std = 200_000, 0.37
    zeros = {"w": np.zeros((400, 250), np.float32), "b": np.zeros(100_000, np.float32),
             "count": np.array(3, np.int64)}
    noisy = add_gaussian_noise(zeros, std, noise_generator(seed=1234))
    draws = np.concatenate([noisy["w"].ravel(), noisy["b"].ravel()]).astype(np.float64)
    assert draws.size == 2 * 100_000 == n
    assert draws.std() == pytest.approx(std, rel=0.01)
    assert abs(draws.mean()) < 5 * std / math.sqrt(n)
    assert noisy["count"] is zeros["count"]
    # Independent coordinates: no correlation between neighbours.
    assert abs(np.corrcoef(draws[:-1], draws[1:])[0, 1]) < 0.01
    # The same seed gives the same noise (tests); no seed gives fresh noise each time.
    again = add_gaussian_noise(zeros, std, noise_generator(seed=1234))
    np.testing.assert_array_equal(again["w"], noisy["w"])
    fresh = add_gaussian_noise(zeros, std, noise_generator())
    assert not np.array_equal(fresh["w"], noisy["w"])


def test_zero_noise_is_the_identity():
    arr = {"w": np.arange(6, dtype=np.float32)}
    np.testing.assert_array_equal(add_gaussian_noise(arr, 0.0, noise_generator(1))["w"], arr["w"])


# ---- adaptive clipping (Andrew et al. 2021) ---------------------------------------------------


def test_adaptive_clip_moves_geometrically_towards_the_quantile():
    clip0 = AdaptiveClip(clip_norm=1.0, target_quantile=0.5, learning_rate=0.2, count_stddev=0.0)
    rng = noise_generator(0)
    # All ten updates within the clip: fraction 1, so C * exp(-0.2 * 0.5).
    assert clip0.next([0.5] * 10, rng).clip_norm == pytest.approx(math.exp(-0.1))
    # None within: C * exp(+0.1).
    assert clip0.next([2.0] * 10, rng).clip_norm == pytest.approx(math.exp(0.1))
    # Over many rounds it settles at the median of the norms.
    c = AdaptiveClip(clip_norm=0.1, target_quantile=0.5, learning_rate=0.2)
    norms = np.random.default_rng(3).lognormal(mean=0.0, sigma=0.5, size=100)
    for _ in range(300):
        c = c.next(norms, rng)
    assert c.clip_norm == pytest.approx(float(np.median(norms)), rel=0.1)


def test_adaptive_clip_count_noise_takes_its_share_of_the_noise():
    z = update_noise_multiplier(1.0, count_stddev=5.0)
    assert 1 / z**2 + 1 / (2 * 5.0) ** 2 == pytest.approx(1.0)
    assert z > 1.0
    assert update_noise_multiplier(0.0, 1.0) == 0.0
    with pytest.raises(ValueError):
        update_noise_multiplier(2.0, 1.0)


# ---- the accountant ---------------------------------------------------------------------------


def test_accountant_matches_opacus_rdp_on_the_dp_sgd_mnist_setting():
    # Abadi et al.'s MNIST setting (batch 256 of 60000, z = 1.1, 60 epochs): dp-accounting's RDP
    # against Opacus's RDP accountant, an implementation of its own.
    from opacus.accountants import RDPAccountant

    q, z, steps = 256 / 60000, 1.1, 60 * 60000 // 256
    ours = epsilon_of([RoundEvent(q, z)] * steps, 1e-5, "rdp")
    reference = RDPAccountant()
    reference.history = [(z, q, steps)]
    assert ours == pytest.approx(reference.get_epsilon(1e-5), rel=1e-6)
    assert 2.5 < ours < 2.7


def test_pld_accountant_matches_the_analytic_gaussian():
    # One round, every node (q = 1): the Gaussian mechanism, whose exact epsilon Balle and
    # Wang's analytic formula gives.
    for z in (0.8, 1.0, 2.0):
        ours = epsilon_of([RoundEvent(1.0, z)], 1e-5, "pld")
        assert ours == pytest.approx(dp_accounting.get_epsilon_gaussian(z, 1e-5), rel=1e-3)
    # RDP is an upper bound on the same.
    assert epsilon_of([RoundEvent(1.0, 1.0)], 1e-5, "rdp") > epsilon_of(
        [RoundEvent(1.0, 1.0)], 1e-5, "pld")


def test_accountant_records_rounds_and_survives_a_checkpoint():
    acc = Accountant(1e-5)
    assert acc.epsilon == 0.0 and acc.rounds == 0
    spent = [acc.record(0.5, 1.2) for _ in range(4)]
    assert spent == sorted(spent) and spent[0] > 0
    assert acc.epsilon == pytest.approx(epsilon_of([RoundEvent(0.5, 1.2)] * 4, 1e-5))
    back = Accountant.from_list(acc.to_list(), 1e-5)
    assert back.epsilon == acc.epsilon and back.rounds == 4
    assert epsilon_of([RoundEvent(1.0, 0.0)], 1e-5) == math.inf
    with pytest.raises(ValueError):
        RoundEvent(0.0, 1.0)
    with pytest.raises(ValueError):
        Accountant(1e-5, "moments")


def test_budget_stops_exactly_before_it_would_be_exceeded():
    # Run rounds while the next one fits: the last round run stays within the target and one
    # more would cross it.
    q, z, target = 0.3, 1.5, 3.0
    acc = Accountant(1e-5)
    while not acc.would_exceed(target, q, z):
        acc.record(q, z)
    assert 0 < acc.rounds < 200
    assert acc.epsilon <= target < acc.epsilon_after(q, z)
    assert epsilon_of([RoundEvent(q, z)] * acc.rounds, 1e-5) <= target
    assert epsilon_of([RoundEvent(q, z)] * (acc.rounds + 1), 1e-5) > target
    assert BUDGET_SPENT_REASON == "privacy budget spent"


def test_noise_derived_from_a_budget_spends_at_most_the_budget():
    z = noise_for_budget(3.0, 1e-5, 0.1, 100)
    spent = epsilon_of([RoundEvent(0.1, z)] * 100, 1e-5)
    assert spent <= 3.0
    # And barely less: a visibly smaller noise would exceed it.
    assert epsilon_of([RoundEvent(0.1, z * 0.99)] * 100, 1e-5) > 3.0


def test_job_privacy_default_is_none_and_job_round_trips():
    assert Job(task="x").privacy is None


def test_distributed_dp_runs_under_secure_aggregation():
    table = {"mode": "distributed", "clip_norm": 1, "noise_multiplier": 1}
    job = parse_job({"task": "digits", "min_nodes": 3, "privacy": table,
                     "secure_aggregation": {"clip": 6.0}})
    assert job.privacy is not None and job.privacy.mode == "distributed"
    assert job.secure_aggregation is not None
    # Noise derived from the budget: the range is checked per round, once z is known.
    assert parse_job({"task": "digits", "min_nodes": 3, "secure_aggregation": True,
                      "privacy": {"mode": "distributed", "clip_norm": 1,
                                  "target_epsilon": 5}}).privacy


def test_distributed_dp_refuses_what_it_cannot_protect():
    with pytest.raises(ConfigError, match="adaptive_clip cannot run with mode = \"distributed\""
                       ".*clipped-bit would leak through secure aggregation"):
        parse_job({"task": "digits", "secure_aggregation": {"clip": 10.0}, "min_nodes": 3,
                   "privacy": {"mode": "distributed", "adaptive_clip": True,
                               "noise_multiplier": 1}})
    # A quantisation range that would cut the sites' noise (threshold 2: share std z C / 1.41).
    with pytest.raises(ConfigError, match=r"clip = 1 cuts the noise shares.*= 5\.243; set "
                       r"\[secure_aggregation\] clip to at least that"):
        parse_job({"task": "digits", "min_nodes": 3,
                   "secure_aggregation": {"clip": 1.0, "threshold": 2},
                   "privacy": {"mode": "distributed", "clip_norm": 1, "noise_multiplier": 1}})


@pytest.mark.parametrize(("mode", "needed"), [("central", 4.05), ("local", 8.09)])
def test_a_budget_that_cannot_pay_for_one_round_is_refused_naming_the_noise(
        mode: str, needed: float) -> None:
    # z = 1 spends 4.73 (central, RDP) in one round: a target of 1 could never hold, and the
    # job would "finish" with no round. Local mode accounts z / 2, so it needs twice z.
    with pytest.raises(ConfigError, match=r"one round at noise_multiplier = 1 spends epsilon "
                       r"[\d.]+, more than target_epsilon = 1: no round would run; set "
                       rf"noise_multiplier to at least {needed}\d*, or target_epsilon to at "
                       r"least [\d.]+"):
        parse_privacy({"mode": mode, "clip_norm": 1.0, "noise_multiplier": 1.0,
                       "target_epsilon": 1.0})
    # Derived from the budget, or enough noise: accepted.
    parse_privacy({"mode": mode, "clip_norm": 1.0, "target_epsilon": 1.0})
    parse_privacy({"mode": mode, "clip_norm": 1.0, "noise_multiplier": needed + 0.01,
                   "target_epsilon": 1.0})
    with pytest.raises(ConfigError, match="no round would run"):
        parse_privacy({"mode": mode, "clip_norm": 1.0, "noise_multiplier": needed - 0.02,
                       "target_epsilon": 1.0})
