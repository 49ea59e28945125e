"""Pure array math for aggregation: arrays in, arrays out, no server state."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

Spec = Mapping[str, tuple[str, tuple[int, ...]]]


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    # Half-precision sums lose digits fast; float32 is exact enough for averaging and
    # halves the memory of float64. Integers and float64 keep float64.
    if dtype.kind == "f" and dtype.itemsize <= 4 or dtype.kind == "V" or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return np.dtype(np.float64)


class WeightedSum:
    """Running sum of w_i * x_i and of w_i: a weighted mean in O(model) memory, any K."""

    def __init__(self, like: Mapping[str, np.ndarray]) -> None:
        self._dtypes = {k: v.dtype for k, v in like.items()}
        self._acc = {k: np.zeros(v.shape, _acc_dtype(v.dtype)) for k, v in like.items()}
        largest = max((v.size for v in like.values()), default=0)
        # One scratch buffer reused for every tensor: w * x without a temporary per call.
        self._scratch = {
            dt: np.empty(largest, dt) for dt in {a.dtype for a in self._acc.values()}
        }
        self.total_weight = 0.0
        self.count = 0

    def add(self, tensors: Mapping[str, np.ndarray], weight: float) -> None:
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")
        for name, acc in self._acc.items():
            x = tensors[name]
            if x.size == 0:
                continue
            scratch = self._scratch[acc.dtype][: x.size].reshape(x.shape)
            np.multiply(x, weight, out=scratch, casting="unsafe")
            acc += scratch
        self.total_weight += weight
        self.count += 1

    def mean(self) -> dict[str, np.ndarray]:
        if self.count == 0:
            raise ValueError("no updates were added")
        out: dict[str, np.ndarray] = {}
        for name, acc in self._acc.items():
            avg = acc / self.total_weight
            dtype = self._dtypes[name]
            if dtype.kind in "iub":
                avg = np.rint(avg)
            out[name] = avg.astype(dtype)
        return out


def weighted_mean(updates: list[tuple[Mapping[str, np.ndarray], float]]) -> dict[str, np.ndarray]:
    """Convenience over WeightedSum for a list already in memory (tests, robust fallbacks)."""
    if not updates:
        raise ValueError("no updates")
    acc = WeightedSum(updates[0][0])
    for tensors, weight in updates:
        acc.add(tensors, weight)
    return acc.mean()


def weighted_metric(values: list[tuple[float, float]]) -> float | None:
    """Mean of (value, weight) pairs; None when there is nothing to average."""
    total = sum(w for _, w in values)
    if total <= 0:
        return None
    return sum(v * w for v, w in values) / total
