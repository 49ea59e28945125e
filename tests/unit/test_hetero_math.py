"""FedNova and FedBuff arithmetic against hand-computed examples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.server.strategies import make_strategy
from fedgpu.server.strategies.hetero_math import (
    StalenessWeighting,
    buffer_factor,
    fednova_factor,
    local_steps_norm,
    staleness_refusal,
    staleness_weight,
)
from fedgpu.server.strategies.update import UpdateIn


def test_local_steps_norm_by_hand() -> None:
    assert local_steps_norm(7) == 7.0
    # rho = 0.5, tau = 2: gradient 0 is applied at steps 0 and 1 (1 + 0.5), gradient 1 once.
    assert local_steps_norm(2, 0.5) == pytest.approx(2.5)
    # Large tau: tau / (1 - rho) minus a constant.
    assert local_steps_norm(100, 0.9) == pytest.approx((100 - 0.9 * (1 - 0.9**100) / 0.1) / 0.1)
    with pytest.raises(ValueError, match="positive"):
        local_steps_norm(0)


def test_fednova_hand_computed_example() -> None:
    # Global x = 0. Site 1: 3 examples, 1 step, x1 = 1 (d1 = 1/1 = 1). Site 2: 1 example,
    # 3 steps, x2 = 6 (d2 = 6/3 = 2). p = (0.75, 0.25).
    # The paper's tau_eff = 0.75 * 1 + 0.25 * 3 = 1.5; x_new = 1.5 * (0.75 * 1 + 0.25 * 2) =
    # 1.875 (F = 1.25). FedAvg would give 0.75 * 1 + 0.25 * 6 = 2.25: pulled toward the site
    # that ran longer.
    s = make_strategy("fednova", {"max_factor": 10})
    g = {"w": np.array([0.0, 10.0], np.float32), "n": np.array(4, np.int64)}
    s.begin_round(g)
    s.add(UpdateIn({"w": np.array([1.0, 11.0], np.float32), "n": np.array(5, np.int64)}, 3,
                   local_steps=1))
    s.add(UpdateIn({"w": np.array([6.0, 16.0], np.float32), "n": np.array(9, np.int64)}, 1,
                   local_steps=3))
    out = s.finish()
    np.testing.assert_allclose(out["w"], [1.875, 11.875], rtol=1e-6)
    assert out["w"].dtype == np.float32
    # Integer tensors (counters) take the normalised mean as it is: omega = n / a = (3, 1/3),
    # (5 * 3 + 9 / 3) / (10 / 3) = 5.4, rounded.
    assert out["n"] == 5
    # The factor by the closed form: (sum n a)(sum n / a) / n^2 = (3 + 3)(3 + 1/3) / 16.
    assert fednova_factor([3, 1], [1, 3]) == pytest.approx(6 * (10 / 3) / 16)
    assert s.last_factor == pytest.approx(1.25)  # type: ignore[attr-defined]


def test_fednova_by_default_never_steps_past_the_sites_models() -> None:
    """F capped at max_factor = 1 (the default): the new model is the omega-weighted mean of
    the sites' models, (3 * 1 + 1/3 * 6) / (10/3) = 1.5, inside their hull, where the paper's
    factor (1.25 here, 3+ with a 10x spread of steps) extrapolates past them."""
    s = make_strategy("fednova")
    g = {"w": np.array([0.0, 10.0], np.float32)}
    s.begin_round(g)
    s.add(UpdateIn({"w": np.array([1.0, 11.0], np.float32)}, 3, local_steps=1))
    s.add(UpdateIn({"w": np.array([6.0, 16.0], np.float32)}, 1, local_steps=3))
    np.testing.assert_allclose(s.finish()["w"], [1.5, 11.5], rtol=1e-6)
    assert s.last_factor == 1.0  # type: ignore[attr-defined]
    # A fast site's 500 steps against two slow sites' 50, momentum 0.9: capped from ~3.
    nova = make_strategy("fednova", {"local_momentum": 0.9})
    nova.begin_round(g)
    for steps in (500, 50, 50):
        nova.add(UpdateIn({"w": np.array([1.0, 11.0], np.float32)}, 100, local_steps=steps))
    np.testing.assert_allclose(nova.finish()["w"], [1.0, 11.0], rtol=1e-6)
    norms = [local_steps_norm(t, 0.9) for t in (500, 50, 50)]
    assert fednova_factor([100] * 3, norms) > 2.5
    with pytest.raises(ConfigError, match="max_factor"):
        make_strategy("fednova", {"max_factor": 0.5})


def test_fednova_is_fedavg_when_local_work_is_equal() -> None:
    rng = np.random.default_rng(0)
    g = {"w": rng.standard_normal(50).astype(np.float32)}
    ups = [({"w": rng.standard_normal(50).astype(np.float32)}, n) for n in (5, 9, 2)]
    nova, avg = make_strategy("fednova", {"local_momentum": 0.9}), make_strategy("fedavg")
    nova.begin_round(g)
    avg.begin_round(g)
    for u, n in ups:
        nova.add(UpdateIn(u, n, local_steps=40))
        avg.add(UpdateIn(u, n))
    np.testing.assert_allclose(nova.finish()["w"], avg.finish()["w"], rtol=1e-5, atol=1e-6)


def test_fednova_on_deltas_and_its_refusals() -> None:
    s = make_strategy("fednova", {"server_lr": 0.5, "max_factor": 100})
    s.deltas = True  # type: ignore[attr-defined]
    g = {"w": np.array([10.0], np.float32)}
    s.begin_round(g)
    s.add(UpdateIn({"w": np.array([1.0], np.float32)}, 3, local_steps=1))
    s.add(UpdateIn({"w": np.array([6.0], np.float32)}, 1, local_steps=3))
    np.testing.assert_allclose(s.finish()["w"], [10 + 0.5 * 1.875], rtol=1e-6)
    s.begin_round(g)
    with pytest.raises(ValueError, match="local steps"):
        s.add(UpdateIn({"w": np.array([1.0], np.float32)}, 3))
    with pytest.raises(ConfigError, match="local_momentum"):
        make_strategy("fednova", {"local_momentum": 1.0})


def test_staleness_weights_and_bound() -> None:
    assert staleness_weight(0) == 1.0
    assert staleness_weight(3) == pytest.approx(0.5)
    assert staleness_weight(8) == pytest.approx(1 / 3)
    assert staleness_weight(3, StalenessWeighting.POLY, 1.0) == pytest.approx(0.25)
    assert staleness_weight(50, StalenessWeighting.CONSTANT) == 1.0
    with pytest.raises(ValueError):
        staleness_weight(-1)
    assert staleness_refusal(4, 4) is None
    reason = staleness_refusal(5, 4)
    assert reason is not None and "5 versions old" in reason and "max_staleness is 4" in reason
    # A buffer of fresh updates is FedAvg of the buffer (factor 1); stale ones pull less.
    assert buffer_factor([3, 1], [1.0, 1.0]) == 1.0
    assert buffer_factor([3, 1], [1.0, 0.5]) == pytest.approx(0.875)
    assert math.isclose(buffer_factor([1e15, 1], [1.0, 1.0]), 1.0)
