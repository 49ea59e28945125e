"""FedYogi and FedAdagrad against Flower's published formulas, over several rounds (the moments
carry across them) and through a checkpoint and resume.

The reference below is a straight-line transcription of Flower's code (adap/flower,
framework/py/flwr/serverapp/strategy/fedopt.py `_compute_deltat_and_mt`, fedyogi.py and
fedadagrad.py `aggregate_train`, with the weighted mean of flwr/server/strategy/aggregate.py
`aggregate`), on float32 arrays as Flower computes them. It does not call our code."""

from __future__ import annotations

from functools import reduce
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core.job.strategies import STRATEGY_SPECS
from fedgpu.core.privacy import parse_privacy
from fedgpu.server.rounds.checkpoint import Checkpointer
from fedgpu.server.strategies import make_strategy
from fedgpu.server.strategies.private import PrivateStrategy
from fedgpu.server.strategies.update import UpdateIn

RNG = np.random.default_rng(34)
SHAPES = {"conv.w": (8, 3, 3, 3), "fc.w": (40, 16), "fc.b": (16,)}

# ---- the reference: Flower's formulas, transcribed (not our implementation) ----------------


def flower_aggregate(results: list[tuple[list[np.ndarray], int]]) -> list[np.ndarray]:
    """flwr.server.strategy.aggregate.aggregate: the weighted average by examples."""
    num_examples_total = sum(num_examples for (_, num_examples) in results)
    weighted_weights = [[layer * num_examples for layer in weights]
                        for weights, num_examples in results]
    return [reduce(np.add, layer_updates) / num_examples_total
            for layer_updates in zip(*weighted_weights, strict=True)]


class FlowerFedOpt:
    """FedOpt's state and FedYogi's / FedAdagrad's aggregate_train (Flower: FedAdagrad fixes
    beta_1 = beta_2 = 0)."""

    def __init__(self, kind: str, current: list[np.ndarray], eta: float, beta_1: float,
                 beta_2: float, tau: float) -> None:
        self.kind, self.current_arrays = kind, current
        self.eta, self.beta_1, self.beta_2, self.tau = eta, beta_1, beta_2, tau
        self.m_t: list[np.ndarray] | None = None
        self.v_t: list[np.ndarray] | None = None

    def aggregate_train(self, results: list[tuple[list[np.ndarray], int]]) -> list[np.ndarray]:
        aggregated = flower_aggregate(results)
        delta_t = [x - y for x, y in zip(aggregated, self.current_arrays, strict=True)]
        if not self.m_t:
            self.m_t = [np.zeros_like(v) for v in aggregated]
        self.m_t = [self.beta_1 * v + (1 - self.beta_1) * d
                    for v, d in zip(self.m_t, delta_t, strict=True)]
        if not self.v_t:
            self.v_t = [np.zeros_like(v) for v in aggregated]
        if self.kind == "fedyogi":
            self.v_t = [v - (1.0 - self.beta_2) * (d**2) * np.sign(v - d**2)
                        for v, d in zip(self.v_t, delta_t, strict=True)]
        else:
            self.v_t = [v + (d**2) for v, d in zip(self.v_t, delta_t, strict=True)]
        new = [x + self.eta * m / (np.sqrt(v) + self.tau)
               for x, m, v in zip(self.current_arrays, self.m_t, self.v_t, strict=True)]
        self.current_arrays = new  # configure_train of the next round sends these
        return new


# ---- the tests -----------------------------------------------------------------------------


def flower_params(name: str, params: dict[str, float]) -> dict[str, float]:
    """What Flower's constructor gets: its defaults (our table's), overridden by `params`."""
    p = {**STRATEGY_SPECS[name].defaults(), **params}
    if name == "fedadagrad":
        p["beta_1"] = p["beta_2"] = 0.0
    return {k: float(p[k]) for k in ("eta", "beta_1", "beta_2", "tau")}


def model() -> dict[str, np.ndarray]:
    return {k: (0.1 * RNG.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def updates_near(g: dict[str, np.ndarray], k: int, step: float
                 ) -> list[tuple[dict[str, np.ndarray], int]]:
    """K sites' models after local training: the global model moved along a common direction
    of about `step` per weight (its sign random per weight and round), each site with 20 %
    noise of its own. A pseudo-gradient element is then never at float32's rounding floor,
    where any two float32 means (Flower's, ours) differ in their last digits and the
    optimisers' ratio m / (sqrt(v) + tau) magnifies that."""
    direction = {n: step * RNG.choice([-1.0, 1.0], v.shape) * RNG.uniform(0.5, 1.5, v.shape)
                 for n, v in g.items()}
    return [({n: (v + direction[n] * (1 + 0.2 * RNG.standard_normal(v.shape))
                  ).astype(np.float32) for n, v in g.items()},
             int(RNG.integers(1, 500))) for _ in range(k)]


def run_round(strategy, g, updates):  # type: ignore[no-untyped-def]
    strategy.begin_round(g)
    for tensors, n in updates:
        strategy.add(UpdateIn(tensors, n))
    new = strategy.finish()
    assert strategy.pending_problem() is None
    strategy.commit()
    return new


@pytest.mark.parametrize("k", [3, 10, 50])
@pytest.mark.parametrize(("name", "params"), [
    ("fedyogi", {}),
    ("fedyogi", {"eta": 0.05, "beta_1": 0.5, "beta_2": 0.9, "tau": 1e-2}),
    ("fedadagrad", {}),
    ("fedadagrad", {"eta": 0.03, "tau": 1e-4}),
])
def test_matches_flower_over_rounds(name: str, params: dict[str, float], k: int) -> None:
    g = model()
    keys = list(g)
    ours = make_strategy(name, params)
    ref = FlowerFedOpt(name, [g[n].copy() for n in keys], **flower_params(name, params))
    # Rounds that move far, then near: the second moment grows and (Yogi) shrinks again.
    for step in (0.05, 0.005, 0.05, 0.002, 0.02):
        updates = updates_near(dict(zip(keys, ref.current_arrays, strict=True)), k, step)
        want = ref.aggregate_train([([u[n] for n in keys], m) for u, m in updates])
        g = run_round(ours, g, updates)
        for n, w in zip(keys, want, strict=True):
            assert w.dtype == np.float32 and g[n].dtype == np.float32
            # 1e-5 relative; an element that lands near 0 (x + a step of the other sign)
            # keeps the absolute rounding of its operands: 1e-6 of the tensor's scale.
            np.testing.assert_allclose(g[n], w, rtol=1e-5, atol=1e-6 * float(np.abs(w).max()))
        # The moments themselves, not only the model they give: within 1e-5 of each tensor's
        # scale (an element whose delta nearly cancels differs in the last float32 digits of
        # the mean, Flower's as much as ours).
        assert ref.v_t is not None and ref.m_t is not None
        slots = ("m", "v") if name == "fedyogi" else ("v",)
        for i, n in enumerate(keys):
            for slot, want_moment in zip(("m", "v"), (ref.m_t[i], ref.v_t[i]), strict=True):
                if slot in slots:
                    got = ours.arrays[slot][n]  # type: ignore[attr-defined]
                    np.testing.assert_allclose(got, want_moment, rtol=1e-5,
                                               atol=1e-5 * float(np.abs(want_moment).max()))
    assert ours.state() == {"steps": 5}


def test_yogi_and_adagrad_differ_from_adam_and_each_other() -> None:
    # The cases above could pass with one shared formula only if they were blind: not so.
    g = model()
    updates = updates_near(g, 10, 0.01)
    out = {n: run_round(make_strategy(n, {"eta": 0.05, "tau": 1e-3}), g, updates)["fc.w"]
           for n in ("fedadam", "fedyogi", "fedadagrad")}
    assert not np.allclose(out["fedyogi"], out["fedadagrad"], rtol=1e-4)
    # Round one of Yogi equals Adam's (v = (1 - beta_2) delta^2 from zero in both) ...
    np.testing.assert_allclose(out["fedyogi"], out["fedadam"], rtol=1e-6)
    # ... round two does not: Yogi's v moves by a signed, additive step.
    a, y = make_strategy("fedadam"), make_strategy("fedyogi")
    ga = gy = g
    for step in (0.05, 0.001):
        ups = updates_near(g, 10, step)
        ga, gy = run_round(a, ga, ups), run_round(y, gy, ups)
    assert not np.allclose(ga["fc.w"], gy["fc.w"], rtol=1e-4)


@pytest.mark.parametrize("name", ["fedyogi", "fedadagrad"])
def test_moments_survive_checkpoint_and_resume(name: str, tmp_path: Path) -> None:
    g0 = model()
    rounds = [updates_near(g0, 5, s) for s in (0.03, 0.01, 0.03, 0.005)]
    straight, want = make_strategy(name), g0
    for ups in rounds:
        want = run_round(straight, want, ups)

    first, g = make_strategy(name), g0
    for ups in rounds[:2]:
        g = run_round(first, g, ups)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(g, {"global_round": 2, "strategy": first.state()}, tensors=first.tensor_state())
    weights, state = ckpt.load()  # type: ignore[misc]
    resumed = make_strategy(name)
    resumed.load_state(state["strategy"], ckpt.load_strategy_tensors(state["global_round"]))
    g = weights
    for ups in rounds[2:]:
        g = run_round(resumed, g, ups)
    assert resumed.state() == straight.state() == {"steps": 4}
    for n in g:
        np.testing.assert_array_equal(g[n], want[n])  # bit for bit, as if never stopped
    lost, g = make_strategy(name), weights
    for ups in rounds[2:]:
        g = run_round(lost, g, ups)
    assert not np.array_equal(g["fc.w"], want["fc.w"])  # the moments mattered


def test_a_refused_round_leaves_the_moments_as_they_were() -> None:
    # finish() proposes; only commit() keeps (the engine retries a round it refused).
    s, g = make_strategy("fedyogi"), model()
    run_round(s, g, updates_near(g, 3, 0.01))
    before = {n: a.copy() for n, a in s.arrays["v"].items()}  # type: ignore[attr-defined]
    s.begin_round(g)
    for tensors, n in updates_near(g, 3, 0.05):
        s.add(UpdateIn(tensors, n))
    s.finish()  # no commit
    for n, a in before.items():
        np.testing.assert_array_equal(s.arrays["v"][n], a)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["fedyogi", "fedadagrad"])
def test_central_dp_wraps_them_and_noises_the_mean_they_read(name: str) -> None:
    # Their row is mean-only: DP's noise on the mean is what the optimiser reads.
    settings = parse_privacy({"mode": "central", "clip_norm": 10.0, "noise_multiplier": 1.0})
    private = make_strategy(name, {}, settings, 3)
    assert isinstance(private, PrivateStrategy) and private.inner.name == name
    g = model()
    ups = updates_near(g, 4, 0.01)
    noised, plain = run_round(private, g, ups), run_round(make_strategy(name), g, ups)
    assert private.round_report()["noise_std"] > 0  # type: ignore[index]
    assert not np.allclose(noised["fc.w"], plain["fc.w"])
