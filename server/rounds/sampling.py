"""Which nodes take part in a round: a pure function of the pool's names and the job."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable


def sample_size(pool: int, fraction: float, min_nodes: int) -> int:
    """ceil(fraction * pool), at least min_nodes, at most the pool."""
    # Rounded first: 0.07 * 100 is 7.000000000000001 in binary floating point, not 8 nodes.
    k = max(min_nodes, math.ceil(round(fraction * pool, 9)))
    return min(k, pool)


def sample(names: Iterable[str], fraction: float, min_nodes: int, seed: int, number: int,
           attempt: int) -> list[str]:
    """The names chosen for attempt `attempt` of round `number`, sorted.

    Seeded by the job's seed, the round and the attempt, and drawn from the names in sorted
    order: the same pool gives the same sample whatever order (or ids) the nodes registered
    with, and a retried attempt draws afresh.
    """
    ordered = sorted(names)
    k = sample_size(len(ordered), fraction, min_nodes)
    rng = random.Random(f"{seed}:{number}:{attempt}")
    return sorted(rng.sample(ordered, k))
