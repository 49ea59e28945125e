"""Krum and Multi-Krum against Flower's published code, with every update spilled to disk and
the pairwise distances summed slice by slice within the memory budget.

The references below are straight-line transcriptions of Flower (adap/flower): Krum from
framework/py/flwr/server/strategy/aggregate.py (`aggregate_krum`, `_compute_distances`,
`aggregate`), Multi-Krum from framework/py/flwr/serverapp/strategy/strategy_utils.py
(`compute_distances`, `select_multikrum`, `aggregate_arrayrecords`), on float32 arrays. They do
not call our code.

Threat model: up to f of K sites send arbitrary (finite, validated) updates and claim any
example count; Krum keeps the update(s) whose K - f - 2 nearest neighbours are closest, so an
update far from the honest cluster is never kept. The mean of the kept ones weighs them by
examples, as Flower's does, so a kept site's claimed count still sets its share.
"""

from __future__ import annotations

from functools import reduce
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.job.strategies import STRATEGY_SPECS
from fedgpu.core.privacy import parse_privacy
from fedgpu.server.rounds.work import fold_updates
from fedgpu.server.strategies import make_strategy
from fedgpu.server.strategies.krum import Krum
from fedgpu.server.strategies.update import UpdateIn

RNG = np.random.default_rng(2017)
SHAPES = {"conv.w": (4, 3, 3, 3), "fc.w": (30, 10), "fc.b": (10,)}
Result = tuple[list[np.ndarray], int]

# ---- the references: Flower's code, transcribed (not our implementation) -------------------


def flower_aggregate(results: list[Result]) -> list[np.ndarray]:
    """flwr.server.strategy.aggregate.aggregate."""
    num_examples_total = sum(num_examples for (_, num_examples) in results)
    weighted_weights = [[layer * num_examples for layer in weights]
                        for weights, num_examples in results]
    return [reduce(np.add, layer_updates) / num_examples_total
            for layer_updates in zip(*weighted_weights, strict=True)]


def flower_compute_distances(weights: list[list[np.ndarray]]) -> np.ndarray:
    """flwr.server.strategy.aggregate._compute_distances."""
    flat_w = np.array([np.concatenate(p, axis=None).ravel() for p in weights])
    distance_matrix = np.zeros((len(weights), len(weights)))
    for i, flat_w_i in enumerate(flat_w):
        for j, flat_w_j in enumerate(flat_w):
            delta = flat_w_i - flat_w_j
            norm = np.linalg.norm(delta)
            distance_matrix[i, j] = norm**2
    return distance_matrix


def flower_aggregate_krum(results: list[Result], num_malicious: int, to_keep: int
                          ) -> list[np.ndarray]:
    """flwr.server.strategy.aggregate.aggregate_krum (flwr.server.strategy.Krum)."""
    weights = [weights for weights, _ in results]
    distance_matrix = flower_compute_distances(weights)
    num_closest = max(1, len(weights) - num_malicious - 2)
    closest_indices = []
    for distance in distance_matrix:
        closest_indices.append(np.argsort(distance)[1 : num_closest + 1].tolist())
    scores = [np.sum(distance_matrix[i, closest_indices[i]])
              for i in range(len(distance_matrix))]
    if to_keep > 0:
        best_indices = np.argsort(scores)[::-1][len(scores) - to_keep :]
        best_results = [results[i] for i in best_indices]
        return flower_aggregate(best_results)
    return weights[np.argmin(scores)]


def flower_select_multikrum(results: list[Result], num_malicious_nodes: int,
                            num_nodes_to_select: int) -> list[Result]:
    """flwr.serverapp.strategy.strategy_utils.compute_distances and select_multikrum."""
    flat_w = np.stack([np.concatenate(w, axis=None).ravel() for w, _ in results], axis=0)
    norms = np.square(flat_w).sum(axis=1)
    distance_matrix = norms[:, None] + norms[None, :] - 2 * flat_w @ flat_w.T
    num_closest = max(1, len(results) - num_malicious_nodes - 2)
    closest_indices = []
    for distance in distance_matrix:
        closest_indices.append(np.argsort(distance)[1 : num_closest + 1].tolist())
    scores = [np.sum(distance_matrix[i, closest_indices[i]])
              for i in range(len(distance_matrix))]
    best_indices = np.argsort(scores)[:num_nodes_to_select]
    return [results[i] for i in best_indices]


def flower_aggregate_arrayrecords(results: list[Result]) -> list[np.ndarray]:
    """flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords."""
    weights = [float(n) for _, n in results]
    total_weight = sum(weights)
    weight_factors = [w / total_weight for w in weights]
    aggregated: list[np.ndarray] = []
    for (arrays, _), weight in zip(results, weight_factors, strict=True):
        for i, value in enumerate(arrays):
            if i == len(aggregated):
                aggregated.append(value * weight)
            else:
                aggregated[i] += value * weight
    return aggregated


# ---- the tests -----------------------------------------------------------------------------


def model() -> dict[str, np.ndarray]:
    return {k: (0.1 * RNG.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def site_updates(g: dict[str, np.ndarray], honest: int, hostile: int
                 ) -> tuple[list[tuple[dict[str, np.ndarray], int]], set[int]]:
    """Honest sites near the global model, hostile ones far from it (each its own way) and
    claiming many examples; shuffled, with the hostile positions."""
    ups = [({n: (v + 0.02 * RNG.standard_normal(v.shape)).astype(np.float32)
             for n, v in g.items()}, int(RNG.integers(1, 500))) for _ in range(honest)]
    ups += [({n: (v + RNG.uniform(0.5, 3.0) * RNG.standard_normal(v.shape)).astype(np.float32)
              for n, v in g.items()}, 100_000) for _ in range(hostile)]
    order = RNG.permutation(len(ups))
    return [ups[i] for i in order], {int(p) for p, i in enumerate(order) if i >= honest}


def aggregate(strategy, g, updates):  # type: ignore[no-untyped-def]
    strategy.begin_round(g)
    for tensors, n in updates:
        strategy.add(UpdateIn(tensors, n))
    out = strategy.finish()
    strategy.commit()
    return out


def as_results(updates: list[tuple[dict[str, np.ndarray], int]], keys: list[str]
               ) -> list[Result]:
    return [([u[n] for n in keys], m) for u, m in updates]


def assert_equal_to(got: dict[str, np.ndarray], want: list[np.ndarray], keys: list[str]
                    ) -> None:
    for n, w in zip(keys, want, strict=True):
        assert got[n].dtype == np.float32
        np.testing.assert_allclose(got[n], w, rtol=1e-5, atol=1e-6 * float(np.abs(w).max()))


CASES = [(3, 0), (3, 1), (10, 0), (10, 2), (50, 0), (50, 12)]


@pytest.mark.parametrize(("k", "f"), CASES)
@pytest.mark.parametrize("keep", ["none", "two", "half"])
def test_krum_matches_flower(k: int, f: int, keep: str, tmp_path: Path) -> None:
    g = model()
    keys = list(g)
    updates, hostile = site_updates(g, k - f, f)
    to_keep = {"none": 0, "two": 2, "half": k // 2}[keep]
    s = make_strategy("krum", {"num_malicious_clients": f, "num_clients_to_keep": to_keep,
                               "spill_dir": str(tmp_path)})
    got = aggregate(s, g, updates)
    assert_equal_to(got, flower_aggregate_krum(as_results(updates, keys), f, to_keep), keys)
    assert isinstance(s, Krum) and not set(s.last_selected) & hostile
    if to_keep == 0:  # the single best update, exactly as it was sent
        best = updates[s.last_selected[0]][0]
        for n in keys:
            np.testing.assert_array_equal(got[n], best[n])


@pytest.mark.parametrize(("k", "f"), CASES)
@pytest.mark.parametrize("select", ["default", "one", "all_but_f"])
def test_multikrum_matches_flower(k: int, f: int, select: str, tmp_path: Path) -> None:
    g = model()
    keys = list(g)
    updates, hostile = site_updates(g, k - f, f)
    params: dict[str, object] = {"num_malicious_clients": f, "spill_dir": str(tmp_path)}
    n_select = {"default": 1, "one": 1, "all_but_f": k - f}[select]
    if select != "default":
        params["num_clients_to_keep"] = n_select
    s = make_strategy("multikrum", params)
    got = aggregate(s, g, updates)
    chosen = flower_select_multikrum(as_results(updates, keys), f, n_select)
    assert_equal_to(got, flower_aggregate_arrayrecords(chosen), keys)
    assert isinstance(s, Krum) and not set(s.last_selected) & hostile
    assert len(s.last_selected) == n_select


def test_flowers_newer_names_are_aliases() -> None:
    s = make_strategy("multikrum", {"num_malicious_nodes": 2, "num_nodes_to_select": 3})
    assert s.params["num_malicious_clients"] == 2 and s.params["num_clients_to_keep"] == 3


def test_a_tiny_memory_budget_gives_the_same_result(tmp_path: Path) -> None:
    # Distances and the mean come from slices of the spilled updates: 64 bytes a slice cuts
    # every tensor into many, and the result must not change.
    g = model()
    updates, _ = site_updates(g, 9, 3)
    params = {"num_malicious_clients": 3, "num_clients_to_keep": 4, "spill_dir": str(tmp_path)}
    whole = aggregate(make_strategy("krum", params), g, updates)
    sliced = make_strategy("krum", params)
    sliced.budget_bytes = 64  # type: ignore[attr-defined]
    got = aggregate(sliced, g, updates)
    for n in g:
        np.testing.assert_allclose(got[n], whole[n], rtol=1e-6, atol=1e-7)


def test_updates_wait_on_disk_not_in_memory_and_go_after_the_round(tmp_path: Path) -> None:
    g = model()
    updates, _ = site_updates(g, 5, 0)
    s = make_strategy("krum", {"spill_dir": str(tmp_path)})
    s.begin_round(g)
    for tensors, n in updates:
        s.add(UpdateIn(tensors, n))
    assert len(list(tmp_path.rglob("update-*.safetensors"))) == 5
    s.finish()
    assert list(tmp_path.iterdir()) == []


def test_krum_folds_through_the_rounds_path(tmp_path: Path) -> None:
    # server/rounds/work.py: one update at a time (no add_many), each with its examples.
    g = model()
    keys = list(g)
    updates, _ = site_updates(g, 8, 2)
    s = make_strategy("krum", {"num_malicious_clients": 2, "num_clients_to_keep": 3,
                               "spill_dir": str(tmp_path)})
    assert not s.folds_many
    s.begin_round(g)
    assert fold_updates(s, [(u, n, {}, 0) for u, n in updates]) == [None] * len(updates)
    got = s.finish()
    assert_equal_to(got, flower_aggregate_krum(as_results(updates, keys), 2, 3), keys)


def test_krum_is_refused_with_secure_aggregation_and_dp() -> None:
    # Each update on its own is what Krum reads; secure aggregation only reveals the sum, and
    # DP's noise is calibrated to a mean.
    for name in ("krum", "multikrum"):
        spec = STRATEGY_SPECS[name]
        assert spec.dense_only and not spec.dp_ok
        assert "secure aggregation only reveals their sum" in (spec.secagg_problem or "")
        with pytest.raises(ConfigError, match="needs a strategy that averages"):
            make_strategy(name, {}, parse_privacy({"mode": "central", "clip_norm": 1.0,
                                                   "noise_multiplier": 1.0}), 3)
