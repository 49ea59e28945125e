"""Per-round sampling over the registered pool: sized by fraction/min_nodes, seeded."""

from __future__ import annotations

import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.sampling import sample, sample_size


def pool(n: int, order: int = 1) -> list[str]:
    return [f"node-{i:03d}" for i in list(range(n))[::order]]


def draw(seed: int, names: list[str], number: int, attempt: int = 1, fraction: float = 1.0,
         min_nodes: int = 1) -> list[str]:
    return sample(names, fraction, min_nodes, seed, number, attempt)


def test_ten_of_a_hundred_reproducible_and_covering() -> None:
    a, b = pool(100), pool(100, order=-1)  # another registration order
    rounds = [draw(0, a, r, fraction=0.1, min_nodes=10) for r in range(1, 21)]
    assert all(len(s) == 10 == len(set(s)) for s in rounds)
    assert rounds == [draw(0, b, r, fraction=0.1, min_nodes=10) for r in range(1, 21)]
    assert draw(1, a, 1, fraction=0.1, min_nodes=10) != rounds[0]
    assert draw(0, a, 1, attempt=2, fraction=0.1, min_nodes=10) != rounds[0]
    assert len({n for s in rounds for n in s}) > 80


def test_same_draw_as_before_the_split() -> None:
    # The sample the aggregator drew before sampling became a function of its own (seeded
    # random.Random over the sorted pool): a resumed run must pick the same nodes.
    assert draw(0, pool(10), 1, fraction=0.3, min_nodes=1) == [
        "node-003", "node-008", "node-009"]


@pytest.mark.parametrize(("fraction", "min_nodes", "n", "k"),
                         [(0.07, 1, 100, 7), (0.01, 3, 100, 3), (1.0, 1, 9, 9), (0.5, 20, 10, 10)])
def test_sample_size(fraction: float, min_nodes: int, n: int, k: int) -> None:
    assert sample_size(n, fraction, min_nodes) == k
    assert len(draw(0, pool(n), 1, fraction=fraction, min_nodes=min_nodes)) == k


def test_registry_ids_do_not_change_the_draw() -> None:
    # Node ids carry a random suffix; only names take part in the draw.
    names = []
    for _ in range(2):
        reg = Registry()
        for name in pool(20):
            reg.register(name, "peer", "0", {}, {}, {}, [])
        names.append(draw(5, [n.name for n in reg.alive()], 3, fraction=0.25))
    assert names[0] == names[1]


def test_min_available_nodes_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"'min_available_nodes' must be an integer >= "
                                          r"min_nodes \(10\), got 5"):
        parse_job({"task": "t", "min_nodes": 10, "min_available_nodes": 5})
    assert parse_job({"task": "t"}).min_available_nodes is None
