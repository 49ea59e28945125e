"""Per-round sampling over the registered pool: sized by fraction/min_nodes, seeded."""

from __future__ import annotations

import pytest

from fedgpu.core.config import parse_job
from fedgpu.core.errors import ConfigError
from fedgpu.server.registry import Registry
from fedgpu.server.rounds import Orchestrator


def pool(n: int, order: int = 1) -> Registry:
    reg = Registry()
    for i in list(range(n))[::order]:
        reg.register(f"node-{i:03d}", "peer", "0", {}, {}, {}, [])
    return reg


def sample(seed: int, reg: Registry, number: int, attempt: int = 1, **job: object
           ) -> list[str]:
    orch = Orchestrator(parse_job({"task": "t", "seed": seed, **job}), reg)
    return [n.name for n in orch._sample(reg.alive(), number, attempt)]


def test_ten_of_a_hundred_reproducible_and_covering() -> None:
    job = {"fraction": 0.1, "min_nodes": 10, "min_available_nodes": 100}
    a, b = pool(100), pool(100, order=-1)  # other registration order, other node ids
    rounds = [sample(0, a, r, **job) for r in range(1, 21)]
    assert all(len(s) == 10 == len(set(s)) for s in rounds)
    assert rounds == [sample(0, b, r, **job) for r in range(1, 21)]
    assert sample(1, a, 1, **job) != rounds[0]
    assert sample(0, a, 1, attempt=2, **job) != rounds[0]
    assert len({n for s in rounds for n in s}) > 80


@pytest.mark.parametrize(("fraction", "min_nodes", "n", "k"),
                         [(0.07, 1, 100, 7), (0.01, 3, 100, 3), (1.0, 1, 9, 9), (0.5, 20, 10, 10)])
def test_sample_size(fraction: float, min_nodes: int, n: int, k: int) -> None:
    assert len(sample(0, pool(n), 1, fraction=fraction, min_nodes=min_nodes)) == k


def test_min_available_nodes_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"'min_available_nodes' must be an integer >= "
                                          r"min_nodes \(10\), got 5"):
        parse_job({"task": "t", "min_nodes": 10, "min_available_nodes": 5})
    assert parse_job({"task": "t"}).min_available_nodes is None
