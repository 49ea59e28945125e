"""Server optimisers and robust strategies against direct numpy computations."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.core.job.strategies import JOB_STRATEGIES, STRATEGY_SPECS
from fedgpu.server.rounds.checkpoint import Checkpointer
from fedgpu.server.rounds.ring import RingAverage
from fedgpu.server.strategies import STRATEGIES, make_strategy
from fedgpu.server.strategies.aggregate import coordinate_median, trim_count, trimmed_mean
from fedgpu.server.strategies.fedbuff import FedBuff
from fedgpu.server.strategies.update import UpdateIn

RNG = np.random.default_rng(7)


def model() -> dict[str, np.ndarray]:
    return {
        "w": RNG.standard_normal((3, 5)).astype(np.float32),
        "b": RNG.standard_normal(4).astype(np.float64),
        "h": RNG.standard_normal(6).astype(np.float16),
        "steps": np.array(RNG.integers(0, 100), dtype=np.int64),
    }


def run_round(strategy, global_w, updates):  # type: ignore[no-untyped-def]
    strategy.begin_round(global_w)
    for tensors, n in updates:
        strategy.add(UpdateIn(tensors, n))
    new = strategy.finish()
    strategy.commit()  # what the round engine does once the result is accepted
    return new


def weighted(updates, name):  # type: ignore[no-untyped-def]
    total = sum(n for _, n in updates)
    return sum(u[name].astype(np.float64) * n for u, n in updates) / total


def test_fedavgm_matches_numpy_over_rounds() -> None:
    s = make_strategy("fedavgm", {"server_lr": 0.5, "momentum": 0.8})
    g = model()
    velocity = {k: np.zeros(g[k].shape) for k in ("w", "b", "h")}
    expected = {k: g[k].astype(np.float64) for k in g}
    for _ in range(3):
        updates = [(model(), int(RNG.integers(1, 100))) for _ in range(4)]
        new = run_round(s, g, updates)
        for k in ("w", "b", "h"):
            delta = weighted(updates, k) - g[k].astype(np.float64)
            velocity[k] = 0.8 * velocity[k] + delta
            expected[k] = g[k].astype(np.float64) + 0.5 * velocity[k]
            tol = 1e-2 if g[k].dtype == np.float16 else 1e-5
            np.testing.assert_allclose(new[k], expected[k], rtol=tol, atol=tol)
            assert new[k].dtype == g[k].dtype
        # Counters are not optimised: they take the (rounded) weighted mean.
        assert new["steps"] == np.rint(weighted(updates, "steps"))
        g = new


def test_fedavgm_without_momentum_and_unit_lr_is_fedavg() -> None:
    g = model()
    updates = [(model(), 3), (model(), 9)]
    a = run_round(make_strategy("fedavgm", {"server_lr": 1.0, "momentum": 0.0}), g, updates)
    b = run_round(make_strategy("fedavg"), g, updates)
    for k in a:
        np.testing.assert_allclose(a[k].astype(np.float64), b[k].astype(np.float64),
                                   rtol=1e-5, atol=1e-5)


def test_fedadam_matches_numpy_over_rounds() -> None:
    # The old names beta1, beta2 are aliases of Flower's beta_1, beta_2.
    p = {"eta": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    s = make_strategy("fedadam", p)
    g = model()
    m = {k: 0.0 for k in ("w", "b")}
    v = {k: 0.0 for k in ("w", "b")}
    for _ in range(3):
        updates = [(model(), int(RNG.integers(1, 100))) for _ in range(3)]
        new = run_round(s, g, updates)
        for k in ("w", "b"):
            d = weighted(updates, k) - g[k].astype(np.float64)
            m[k] = 0.9 * m[k] + 0.1 * d
            v[k] = 0.99 * v[k] + 0.01 * d * d
            want = g[k].astype(np.float64) + 0.05 * m[k] / (np.sqrt(v[k]) + 1e-3)
            np.testing.assert_allclose(new[k], want, rtol=1e-4, atol=1e-5)
        g = new
    assert s.state() == {"steps": 3}


@pytest.mark.parametrize("name", ["fedavgm", "fedadam"])
def test_optimiser_state_survives_checkpoint_and_resume(name: str, tmp_path: Path) -> None:
    rounds = [[(model(), int(RNG.integers(1, 50))) for _ in range(3)] for _ in range(4)]
    g0 = model()
    straight = make_strategy(name)
    want = g0
    for updates in rounds:
        want = run_round(straight, want, updates)

    first = make_strategy(name)
    g = g0
    for updates in rounds[:2]:
        g = run_round(first, g, updates)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(g, {"global_round": 2, "strategy": first.state()}, tensors=first.tensor_state())
    # The arrays are safetensors next to the checkpoint, not inside the JSON state.
    assert (tmp_path / "strategy.safetensors").exists()
    assert "velocity" not in (tmp_path / "state.json").read_text()

    weights, state = ckpt.load()  # type: ignore[misc]
    resumed = make_strategy(name)
    resumed.load_state(state["strategy"], ckpt.load_strategy_tensors(state["global_round"]))
    g = weights
    for updates in rounds[2:]:
        g = run_round(resumed, g, updates)
    # Identical to never having stopped, bit for bit.
    assert resumed.state() == straight.state() == {"steps": 4}
    for k in g:
        np.testing.assert_array_equal(g[k], want[k])
    # A fresh optimiser (state lost) would have diverged: the test can fail.
    lost = make_strategy(name)
    g = weights
    for updates in rounds[2:]:
        g = run_round(lost, g, updates)
    assert not np.array_equal(g["w"], want["w"])
    # Moments saved with another round are not paired with this checkpoint.
    assert ckpt.load_strategy_tensors(3) is None


# ---- robust statistics ---------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 10])
def test_coordinate_median_matches_numpy(k: int) -> None:
    block = RNG.standard_normal((k, 101))
    want = np.median(block, axis=0)
    got = coordinate_median(block.copy())
    np.testing.assert_allclose(got, want)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("k", [1, 2, 5, 6, 11])
@pytest.mark.parametrize("trim", [0.0, 0.1, 0.2, 0.25, 0.4, 0.4999])
def test_trimmed_mean_matches_sorted_numpy(k: int, trim: float) -> None:
    block = RNG.standard_normal((k, 53))
    t = min(int(np.floor(trim * k)), (k - 1) // 2)
    want = np.sort(block, axis=0)[t : k - t].mean(axis=0)
    np.testing.assert_allclose(trimmed_mean(block.copy(), trim), want)


def test_trim_bounds() -> None:
    block = RNG.standard_normal((5, 9))
    # trim 0 is the plain mean; the largest trim leaves the middle value: the median.
    np.testing.assert_allclose(trimmed_mean(block.copy(), 0.0), block.mean(axis=0))
    np.testing.assert_allclose(trimmed_mean(block.copy(), 0.4999), np.median(block, axis=0))
    assert trim_count(4, 0.4999) == 1 and trim_count(10, 0.1) == 1 and trim_count(9, 0.1) == 0
    for bad in (-0.1, 0.5, 1.0):
        with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
            trim_count(5, bad)


def test_robust_strategies_ignore_an_outlier_and_weights(tmp_path: Path) -> None:
    g = model()
    honest = [model() for _ in range(4)]
    liar = {k: (np.full_like(v, 1e4) if v.dtype.kind == "f" else v) for k, v in g.items()}
    updates = [(u, 10) for u in honest] + [(liar, 10_000)]
    for name, params in (("median", {}), ("trimmed_mean", {"trim": 0.2})):
        out = run_round(make_strategy(name, {**params, "spill_dir": str(tmp_path)}), g, updates)
        stack = np.stack([u["w"] for u, _ in updates]).astype(np.float32)
        want = (np.median(stack, axis=0) if name == "median"
                else np.sort(stack, axis=0)[1:4].mean(axis=0))
        np.testing.assert_allclose(out["w"], want, rtol=1e-5, atol=1e-6)
        assert np.abs(out["w"]).max() < 100
        assert out["h"].dtype == np.float16 and out["steps"].dtype == np.int64
    # Spill files are removed once the round is aggregated.
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("k", [3, 4])
def test_spilled_median_is_exact_under_a_tiny_memory_budget(k: int, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    big = {"a": RNG.standard_normal((64, 33)).astype(np.float32),
           "c": RNG.standard_normal(1000).astype(np.float16)}
    updates = [({n: RNG.standard_normal(v.shape).astype(v.dtype) for n, v in big.items()}, 1)
               for _ in range(k)]
    s = make_strategy("median", {"memory_budget_mib": 1, "spill_dir": str(tmp_path)})
    # 40 bytes per slice: a few columns at a time, so every tensor is cut in many slices.
    s.budget_bytes = 40
    out = run_round(s, big, updates)
    for n in big:
        stack = np.stack([u[n] for u, _ in updates]).astype(np.float32)
        np.testing.assert_allclose(out[n].astype(np.float32),
                                   np.median(stack, axis=0).astype(big[n].dtype), rtol=1e-3)


def test_retried_round_starts_over(tmp_path: Path) -> None:
    s = make_strategy("median", {"spill_dir": str(tmp_path)})
    g = {"w": np.zeros(3, np.float32)}
    s.begin_round(g)
    s.add(UpdateIn({"w": np.full(3, 100, np.float32)}, 1))
    out = run_round(s, g, [({"w": np.full(3, v, np.float32)}, 1) for v in (1, 2, 3)])
    np.testing.assert_array_equal(out["w"], 2)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("fedadam", {"eta": 0}, "[strategy_params] eta must be a number > 0, got 0"),
        ("fedadam", {"beta1": 1.0}, "[strategy_params] beta_1 must be a number in [0, 1), "
                                    "got 1.0"),
        ("fedadam", {"beta1": 0.8, "beta_1": 0.8}, "beta_1 and beta1 are the same parameter"),
        ("fedavgm", {"momentum": "high"}, "[strategy_params] momentum must be a number"),
        ("fedavgm", {"lr": 1}, "lr not understood by strategy 'fedavgm' (allowed: server_lr, "
                               "momentum)"),
        ("trimmed_mean", {"trim": 0.5}, "trim must be a number in [0, 0.5), got 0.5"),
        ("median", {"memory_budget_mib": 0}, "memory_budget_mib must be an integer >= 1"),
        ("fedavg", {"eta": 1}, "eta not understood by strategy 'fedavg' (allowed: none)"),
        ("fedyogi", {"beta_2": -0.1}, "beta_2 must be a number in [0, 1), got -0.1"),
        ("fedadagrad", {"beta_1": 0.9}, "beta_1 not understood by strategy 'fedadagrad'"),
        ("krum", {"num_malicious_clients": 1.5}, "num_malicious_clients must be an integer"),
        ("multikrum", {"num_clients_to_keep": 0}, "num_clients_to_keep must be an integer "
                                                  ">= 1, got 0"),
    ],
)
def test_bad_strategy_params_are_named(name: str, params: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        make_strategy(name, params)
    assert message in str(err.value)


def test_every_table_row_has_one_class_and_every_class_a_row() -> None:
    # The registry is the table's job-file names, no more, no less; FedBuff and RingAverage
    # and ring rows (mode = "async" and mode = "ring" build them).
    assert list(STRATEGIES) == list(JOB_STRATEGIES)
    internal = {n for n, spec in STRATEGY_SPECS.items() if spec.internal}
    assert internal == {FedBuff.name, RingAverage.name}
    for name in JOB_STRATEGIES:
        s = make_strategy(name)
        assert type(s) is STRATEGIES[name] and s.name == name
        assert s.params == STRATEGY_SPECS[name].defaults()  # the row's defaults, filled in
    with pytest.raises(ConfigError, match="unknown strategy 'fedbuff'"):
        make_strategy("fedbuff")  # internal: not a job file's to name


def test_job_file_names_every_strategy() -> None:
    for name in STRATEGIES:
        job = parse_job({"task": "t", "strategy": name, "strategy_params": {}})
        assert make_strategy(job.strategy, job.strategy_params).name == name
    with pytest.raises(ConfigError, match="'strategy' must be one of"):
        parse_job({"task": "t", "strategy": "bulyan"})  # not in the strategy table


def test_orchestrator_restore_brings_back_the_moments(tmp_path: Path) -> None:
    # The aggregator's own restart path: checkpoint written by one Orchestrator, restored by
    # a fresh one, the optimiser arrays equal to the ones saved.
    from fedgpu.server.registry import Registry
    from fedgpu.server.rounds.engine import Orchestrator

    job = parse_job({"task": "t", "strategy": "fedadam"})
    first = Orchestrator(job, Registry(), checkpointer=Checkpointer(tmp_path))
    g = model()
    for _ in range(2):
        g = run_round(first.strategy, g, [(model(), 5), (model(), 7)])
    asyncio.run(first.commit(g, 2))
    again = Orchestrator(job, Registry(), checkpointer=Checkpointer(tmp_path))
    again.restore(*Checkpointer(tmp_path).load())  # type: ignore[misc]
    assert again.global_round == 2 and again.strategy.state() == {"steps": 2}
    for k in ("w", "b", "h"):
        np.testing.assert_array_equal(again.strategy.m[k], first.strategy.m[k])  # type: ignore[attr-defined]
        np.testing.assert_array_equal(again.strategy.v[k], first.strategy.v[k])  # type: ignore[attr-defined]


def test_checkpoint_is_written_off_the_event_loop_from_a_snapshot(tmp_path: Path) -> None:
    # A multi-GB model takes seconds to write and fsync; heartbeats and long polls must go on,
    # and evaluations landing in the history meanwhile must not tear the state being written.
    import threading

    from fedgpu.server.registry import Registry
    from fedgpu.server.rounds.engine import Orchestrator
    from fedgpu.server.rounds.records import RoundRecord

    def record(number: int) -> RoundRecord:
        return RoundRecord(number, 1, "finished", 0.0, 0.0, [], 0, [], None, 0, 0, 0.0)

    class Recording(Checkpointer):
        def save(self, weights, state, tensors=None, same_as=None):  # type: ignore[no-untyped-def]
            self.thread = threading.get_ident()
            orch.history.append(record(99))  # what the loop may do during the write
            super().save(weights, state, tensors, same_as)

    job = parse_job({"task": "t", "strategy": "fedavgm"})
    ck = Recording(tmp_path)
    orch = Orchestrator(job, Registry(), checkpointer=ck)
    orch.history.append(record(1))
    g = run_round(orch.strategy, model(), [(model(), 5), (model(), 7)])

    async def go() -> int:
        await orch.commit(g, 1)
        return threading.get_ident()

    loop_thread = asyncio.run(go())
    assert ck.thread != loop_thread
    weights, state = Checkpointer(tmp_path).load()  # type: ignore[misc]
    assert state["global_round"] == 1
    assert [h["round"] for h in state["history"]] == [1]
    for k, v in g.items():
        np.testing.assert_array_equal(weights[k], v)
