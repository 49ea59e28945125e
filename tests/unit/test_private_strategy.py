"""Central and local DP at the aggregator (server/strategies/private.py): clipping of each
update, noise on the mean, the account per round and the budget that ends the job."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.privacy import BUDGET_SPENT_REASON, parse_privacy
from fedgpu.core.privacy.accountant import RoundEvent, epsilon_of
from fedgpu.core.privacy.mechanisms import difference, l2_norm
from fedgpu.server.strategies import make_strategy
from fedgpu.server.strategies.private import PrivateStrategy
from fedgpu.server.strategies.update import UpdateIn


def _private(strategy: str = "fedavg", rounds: int = 5, **table: object) -> PrivateStrategy:
    settings = parse_privacy({"mode": "central", **table})
    out = make_strategy(strategy, {}, settings, rounds)
    assert isinstance(out, PrivateStrategy)
    return out


def _global(size: int = 20_000) -> dict[str, np.ndarray]:
    return {"w": np.zeros(size, np.float32), "b": np.zeros(10, np.float32),
            "steps": np.array(3, np.int64)}


def _round(s: PrivateStrategy, g: dict[str, np.ndarray], updates: list[dict[str, np.ndarray]],
           examples: list[int] | None = None) -> dict[str, np.ndarray]:
    s.begin_round(g)
    for u, n in zip(updates, examples or [1] * len(updates), strict=True):
        s.add(UpdateIn(u, n))
    new = s.finish()
    assert s.pending_problem() is None
    s.commit()
    return new


def _update(g: dict[str, np.ndarray], seed: int, scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": g["w"] + rng.standard_normal(g["w"].shape).astype(np.float32) * scale,
            "b": g["b"] + scale, "steps": np.array(99, np.int64)}


def test_central_clips_every_update_and_weighs_nodes_equally() -> None:
    s = _private(clip_norm=1.0, noise_multiplier=0.0)
    g = _global()
    ups = [_update(g, i, scale) for i, scale in enumerate((0.001, 0.5, 3.0))]
    new = _round(s, g, ups, examples=[10, 1000, 100_000])
    # Without noise the new model is the plain average of the clipped updates: the node that
    # claims 100000 examples and moved furthest counts no more than the others.
    clipped = []
    for u in ups:
        d = difference(u, g)
        n = l2_norm(d)
        clipped.append({k: v * min(1.0, 1.0 / n) for k, v in d.items()})
    expected = {k: sum(c[k] for c in clipped) / 3 for k in ("w", "b")}
    for k in ("w", "b"):
        np.testing.assert_allclose(new[k], expected[k], atol=1e-5)
    assert l2_norm(difference(new, g)) <= 1.0
    assert new["steps"] == 3  # the integer counter keeps the global value
    report = s.round_report()
    assert report is not None and report["updates"] == 3
    # The exact count of clipped updates is not published (no noise protects it).
    assert "clipped" not in report
    assert report["epsilon"] == math.inf  # no noise: no privacy, and the record says so


def test_central_noise_on_the_mean_has_std_z_c_over_m() -> None:
    z, c, m = 1.3, 0.5, 4
    s = _private(clip_norm=c, noise_multiplier=z)
    g = _global(size=200_000)
    new = _round(s, g, [dict(g) for _ in range(m)])  # updates of norm 0: only noise is left
    draws = new["w"].astype(np.float64)
    assert draws.std() == pytest.approx(z * c / m, rel=0.01)
    assert abs(draws.mean()) < 5 * (z * c / m) / math.sqrt(draws.size)
    assert s.round_report()["noise_std"] == pytest.approx(z * c / m)


@pytest.mark.parametrize("strategy", ["fedavgm", "fedadam"])
def test_server_optimisers_take_the_noised_mean(strategy: str) -> None:
    s = _private(strategy, clip_norm=1.0, noise_multiplier=0.0)
    g = _global()
    new = _round(s, g, [_update(g, 1, 5.0), _update(g, 2, 5.0)])
    assert np.isfinite(new["w"]).all()
    # The optimiser's state rides inside the wrapper's and comes back with its account.
    back = _private(strategy, clip_norm=1.0, noise_multiplier=0.0)
    back.load_state(s.state(), s.tensor_state())
    assert back.inner.state() == s.inner.state() and back.accountant.rounds == 1


def test_budget_ends_the_job_exactly_before_it_would_be_exceeded() -> None:
    target, z = 2.5, 4.0
    s = _private(clip_norm=1.0, noise_multiplier=z, target_epsilon=target, rounds=1000)
    g = _global(1000)
    rounds = 0
    while s.exhausted() is None:
        _round(s, g, [_update(g, rounds, 0.1)])
        rounds += 1
        assert rounds < 100
    assert rounds == 5  # 2.45 after five rounds, 2.71 after six
    assert s.exhausted() == f"privacy budget spent after 5 rounds, epsilon {s.spent():.2f} of 2.5"
    assert s.spent() <= target
    assert epsilon_of([RoundEvent(1.0, z)] * rounds, 1e-5) == pytest.approx(s.spent())
    assert epsilon_of([RoundEvent(1.0, z)] * (rounds + 1), 1e-5) > target
    assert s.round_report()["epsilon"] == pytest.approx(s.spent(), abs=1e-6)


def test_noise_derived_from_the_budget_lasts_the_job() -> None:
    s = _private(clip_norm=1.0, target_epsilon=4.0, rounds=6)
    assert s.noise_multiplier > 0.5
    g = _global(100)
    for i in range(6):
        assert s.exhausted() is None, f"round {i + 1} refused"
        _round(s, g, [_update(g, i, 0.1)])
    assert s.spent() <= 4.0 and s.exhausted().startswith(BUDGET_SPENT_REASON)


def test_account_and_adaptive_clip_survive_a_checkpoint() -> None:
    s = _private(adaptive_clip=True, noise_multiplier=0.5, clipped_count_stddev=1.0)
    g = _global(1000)
    assert s.clip_norm == 0.1
    _round(s, g, [_update(g, i, 1.0) for i in range(5)])  # norms ~30: all clipped
    # Every update above the clip: it grows by about exp(0.2 * 0.5), give or take the noise.
    assert s.clip_norm > 0.1 and "next_clip_norm" in s.round_report()
    # Published: the noised count the clip was made from (0 unclipped plus N(0, 1) noise),
    # never the exact one.
    report = s.round_report()
    assert "clipped" not in report and report["unclipped_noised"] != 0
    assert math.exp(0.2 * (0.5 - report["unclipped_noised"] / 5)) * 0.1 == pytest.approx(
        s.clip_norm, rel=1e-3)
    back = _private(adaptive_clip=True, noise_multiplier=0.5, clipped_count_stddev=1.0)
    back.load_state(s.state())
    assert back.clip_norm == s.clip_norm and back.spent() == s.spent() > 0


def test_adaptive_clipping_leaves_less_noise_for_the_update() -> None:
    s = _private(adaptive_clip=True, noise_multiplier=1.0)
    # Default count noise: at least z, so the update keeps at least 3/4 of the precision.
    assert s.update_multiplier(5) == pytest.approx(1 / math.sqrt(0.75))
    assert s.update_multiplier(100) == pytest.approx((1 - 1 / 100) ** -0.5)


def test_local_mode_accounts_only_and_keeps_the_weights() -> None:
    settings = parse_privacy({"mode": "local", "clip_norm": 1.0, "noise_multiplier": 2.0})
    s = make_strategy("fedavg", {}, settings, 3)
    assert isinstance(s, PrivateStrategy) and not s.central
    assert s.accounted_multiplier == 1.0  # replace-one-node: sensitivity 2C
    g = _global(100)
    ups = [_update(g, 1, 1.0), _update(g, 2, 1.0)]
    new = _round(s, g, ups, examples=[1, 3])
    np.testing.assert_allclose(new["w"], (ups[0]["w"] + 3 * ups[1]["w"]) / 4, atol=1e-6)
    assert s.round_report()["epsilon"] == pytest.approx(epsilon_of([RoundEvent(1.0, 1.0)],
                                                                   1e-5))


def test_privacy_refuses_strategies_that_do_not_average() -> None:
    settings = parse_privacy({"mode": "central", "clip_norm": 1.0, "noise_multiplier": 1.0})
    with pytest.raises(ConfigError, match="needs a strategy that averages"):
        make_strategy("median", {}, settings, 3)


def test_the_nodes_reason_for_no_initial_model_reaches_the_job() -> None:
    # E.g. Opacus refusing the task's model under dp_sgd: the job fails with those words.
    import time

    from fedgpu.core.job import parse_job
    from fedgpu.proto import pb
    from fedgpu.server.rounds.attempt import RoundState
    from fedgpu.server.rounds.plans import InitPlan
    from fedgpu.server.rounds.records import Failure

    plan = InitPlan(parse_job({"task": "images"}))
    rnd = RoundState(number=0, kind=pb.TASK_KIND_INIT, attempt=1, required=1,
                     deadline=time.time() + 60, started=time.time())
    why = "task 'images': Opacus cannot train this model with DP-SGD: BatchNorm ..."
    rnd.failures.append(Failure("n1", "site-a", why))
    error = plan.closed(rnd, None, [], ok=False)
    assert why in plan.give_up(0, error)
    empty = RoundState(number=0, kind=pb.TASK_KIND_INIT, attempt=2, required=1,
                       deadline=time.time() + 60, started=time.time())
    assert plan.give_up(0, plan.closed(empty, None, [], ok=False)) == (
        "no node returned initial weights; check the nodes' logs")


def test_a_resumed_run_continues_the_same_account() -> None:
    import json

    from fedgpu.core import jsondoc
    from fedgpu.core.job import parse_job
    from fedgpu.server.registry import Registry
    from fedgpu.server.rounds.engine import Orchestrator

    job = parse_job({"task": "digits", "rounds": 9, "privacy": {
        "mode": "central", "clip_norm": 1.0, "noise_multiplier": 4.0, "target_epsilon": 2.5}})
    g = _global(100)
    first = Orchestrator(job, Registry(), initial_weights=g)
    assert isinstance(first.strategy, PrivateStrategy)
    for i in range(3):
        _round(first.strategy, g, [_update(g, i, 0.5)])
    state = json.loads(jsondoc.dumps(first.checkpoint_state()))
    state["global_round"] = 3
    again = Orchestrator(job, Registry())
    again.restore(g, state)
    resumed = again.strategy
    assert isinstance(resumed, PrivateStrategy)
    assert resumed.accountant.rounds == 3 and resumed.spent() == first.strategy.spent()
    # Rounds 4 and 5 still fit (2.17, 2.45 of 2.5), the sixth would not: the same stop as
    # without the restart.
    for i in range(2):
        assert resumed.exhausted() is None
        _round(resumed, g, [_update(g, i, 0.5)])
    assert resumed.exhausted().startswith(BUDGET_SPENT_REASON)
