"""The neighbour graph of SecAgg+ (Bell et al. 2020): who agrees masks and holds shares of whom.

A random k-regular graph over the round's sites 1..n: a Harary graph (each site linked to the
k/2 nearest on each side of a cycle, plus the opposite site when k is odd) over a random
permutation of the sites. The permutation is a pure function of a 32-byte seed, drawn with the
protocol's own PRG, so every site and the aggregator derive the same graph whatever their numpy
version. Each site's secrets are shared among its neighbours and itself.
"""

from __future__ import annotations

import numpy as np

from fedgpu.core.secagg.errors import SecAggError
from fedgpu.core.secagg.prg import MaskStream, Scratch


def degree(n: int, neighbours: int | None) -> int:
    """The graph's degree for n sites: all others (None, "all"), else `neighbours` rounded up
    to an even count when n is odd (no k-regular graph has odd n * k), at most n - 1."""
    if n < 1:
        raise SecAggError("a round needs at least one site")
    if neighbours is None or neighbours >= n - 1:
        return n - 1
    if neighbours < 1:
        raise SecAggError(f"neighbours must be at least 1, got {neighbours}")
    k = neighbours + (neighbours * n) % 2
    return min(k, n - 1)


def _permutation(n: int, seed: bytes) -> list[int]:
    """Fisher-Yates with unbiased draws (rejection sampling) from the AES-CTR stream."""
    stream = MaskStream(seed, Scratch(np.dtype("<u8"), 64))
    items = list(range(1, n + 1))
    pool: list[int] = []
    for i in range(n - 1, 0, -1):
        span = i + 1
        limit = (1 << 64) // span * span
        while True:
            if not pool:
                pool = [int(v) for v in stream.next(64)]
            r = pool.pop()
            if r < limit:
                break
        j = r % span
        items[i], items[j] = items[j], items[i]
    return items


def neighbours(n: int, k: int, seed: bytes) -> dict[int, frozenset[int]]:
    """Site index (1..n) -> its k neighbours."""
    if not 0 <= k <= n - 1 or (k < n - 1 and (k * n) % 2):
        raise SecAggError(f"no {k}-regular graph on {n} sites")
    sites = range(1, n + 1)
    if k == n - 1:
        return {i: frozenset(j for j in sites if j != i) for i in sites}
    order = _permutation(n, seed)
    graph: dict[int, set[int]] = {i: set() for i in sites}
    for p, site in enumerate(order):
        for step in range(1, k // 2 + 1):
            graph[site].add(order[(p + step) % n])
            graph[site].add(order[(p - step) % n])
        if k % 2:
            graph[site].add(order[(p + n // 2) % n])
    return {i: frozenset(v) for i, v in graph.items()}
