"""Mixing matrices of D-PSGD ring mode: who averages with whom, and with what weight.

Torch-free and pure: the aggregator validates the job's matrix and ships it to the workers, the
workers derive their neighbours from it. Row r of W holds the weights rank r gives to each
copy when it averages; W must be doubly stochastic so the average of all copies is preserved
by every exchange (columns sum to 1) and every copy is a convex combination (rows sum to 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TOLERANCE = 1e-6


class MixingError(ValueError):
    """A mixing matrix that D-PSGD cannot use; the message says which entry and why."""


def uniform_ring(n: int) -> np.ndarray:
    """Left, self and right with 1/3 each. With N=2 left and right are the same peer, which
    then gets 2/3; with N=1 there is nobody to average with."""
    if n < 1:
        raise MixingError(f"a ring needs at least one node, got {n}")
    w = np.zeros((n, n))
    for r in range(n):
        for j in ((r - 1) % n, r, (r + 1) % n):
            w[r, j] += 1.0 / 3.0
    return w


def check(matrix: object, n: int, source: str = "job") -> np.ndarray:
    """`matrix` (a list of rows) as an NxN float array, or a MixingError naming the problem."""
    if not isinstance(matrix, Sequence) or isinstance(matrix, str) or not all(
        isinstance(row, Sequence) and not isinstance(row, str) for row in matrix
    ):
        raise MixingError(f"{source}: 'mixing' must be \"uniform\" or an array of {n} rows")
    if len(matrix) != n or any(len(row) != n for row in matrix):
        shape = f"{len(matrix)}x{'/'.join(sorted({str(len(r)) for r in matrix})) or 0}"
        raise MixingError(f"{source}: 'mixing' must be {n}x{n} (one row and column per node, "
                          f"min_nodes = {n}), got {shape}")
    for i, row in enumerate(matrix):
        for j, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise MixingError(f"{source}: mixing[{i}][{j}] must be a number, got {v!r}")
    w = np.asarray(matrix, dtype=np.float64)
    if not np.all(np.isfinite(w)):
        raise MixingError(f"{source}: 'mixing' holds a non-finite value")
    neg = np.argwhere(w < 0)
    if len(neg):
        i, j = neg[0]
        raise MixingError(f"{source}: mixing[{i}][{j}] = {w[i, j]} is negative; weights must "
                          "be >= 0")
    for axis, what in ((1, "row"), (0, "column")):
        sums = w.sum(axis=axis)
        bad = np.flatnonzero(np.abs(sums - 1.0) > TOLERANCE)
        if len(bad):
            k = int(bad[0])
            raise MixingError(f"{source}: mixing {what} {k} sums to {sums[k]:.9g}, not 1 "
                              f"(within {TOLERANCE:g}); W must be doubly stochastic")
    return w


def resolve(mixing: str | Sequence[Sequence[float]], n: int, source: str = "job") -> np.ndarray:
    if isinstance(mixing, str):
        if mixing != "uniform":
            raise MixingError(f"{source}: 'mixing' must be \"uniform\" or a {n}x{n} array, "
                              f"got {mixing!r}")
        return uniform_ring(n)
    return check(mixing, n, source)


def peers(w: np.ndarray, rank: int) -> tuple[list[int], list[int]]:
    """(ranks we send our copy to, ranks we receive copies from) for one exchange."""
    n = w.shape[0]
    send = [j for j in range(n) if j != rank and w[j, rank] > 0]
    recv = [j for j in range(n) if j != rank and w[rank, j] > 0]
    return send, recv


def combine(w: np.ndarray, rank: int, own: np.ndarray,
            received: dict[int, np.ndarray]) -> np.ndarray:
    """Row `rank` of W x: the numpy reference the torch exchange is tested against."""
    out = w[rank, rank] * own
    for j, x in received.items():
        out = out + w[rank, j] * x
    return out
