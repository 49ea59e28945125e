"""Pure array math for aggregation: arrays in, arrays out, no server state."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

Spec = Mapping[str, tuple[str, tuple[int, ...]]]

# Elements per block of the weighted sum (1 MiB of float32). numpy has no fused multiply-add,
# so w * x goes through a scratch buffer; a block that stays in L2 means the scratch never
# travels to memory and each update costs one read of x plus one read/write of the sum.
BLOCK = 1 << 18


def acc_dtype(dtype: np.dtype) -> np.dtype:
    # Half-precision sums lose digits fast; float32 is exact enough for averaging and
    # halves the memory of float64. Integers and float64 keep float64.
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize <= 4 or dtype.kind == "V" or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return np.dtype(np.float64)


_acc_dtype = acc_dtype


def cast_back(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """An aggregate in its working dtype back to the model's dtype (integers rounded)."""
    if np.dtype(dtype).kind in "iub":
        values = np.rint(values)
    # No copy when the dtypes already agree (float32 models): the mean is the sum's buffer.
    return values.astype(dtype, copy=False)


class WeightedSum:
    """Running weighted mean of x_i with weights w_i: O(model) memory, any K.

    Kept as the mean so far, not as a sum: folding in updates scales what is there by
    W_old / W_new and each new x_i by w_i / W_new, coefficients in [0, 1] that add up to 1.
    The accumulator is a convex combination of the inputs, so no finite input (however large
    its values or its example count) can overflow it; the sum of w_i * x_i could (1e24 with
    1e15 examples is inf in float32). A rounding step past the dtype's largest value is
    clamped back to it, which is where the exact mean lies.
    """

    def __init__(self, like: Mapping[str, np.ndarray],
                 reuse: Mapping[str, np.ndarray] | None = None) -> None:
        self._dtypes = {k: v.dtype for k, v in like.items()}
        # Uninitialised on purpose: the first add writes c * x straight into it, which saves
        # a pass over zeros the size of the model. `reuse`: arrays of an earlier sum nothing
        # uses any more, taken over where they fit (no page faults for a fresh model's worth).
        self._acc = {k: _scratch_or_new(reuse, k, v.shape, acc_dtype(v.dtype))
                     for k, v in like.items()}
        self._scratch = {
            dt: np.empty(BLOCK, dt) for dt in {a.dtype for a in self._acc.values()}
        }
        self.total_weight = 0.0
        self.count = 0

    def add(self, tensors: Mapping[str, np.ndarray], weight: float) -> None:
        self.add_many([(tensors, weight)])

    def add_many(self, updates: Sequence[tuple[Mapping[str, np.ndarray], float]]) -> None:
        """Fold in several updates in one sweep: the mean is read and written once per block
        for all of them, so K updates held in memory cost K reads of x and one of the mean."""
        if not updates:
            return
        if not self._acc and self._dtypes:
            raise ValueError("this sum's mean() was already taken; start a new WeightedSum")
        for _, weight in updates:
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError(f"weight must be positive and finite, got {weight}")
        weights = [float(w) for _, w in updates]
        total = self.total_weight + math.fsum(weights)
        keep = self.total_weight / total  # the share of what is already in the mean
        coeffs = [w / total for w in weights]
        for name, acc in self._acc.items():
            if acc.size == 0:
                continue
            flat = acc.reshape(-1)
            xs = [np.asarray(t[name]).reshape(-1) for t, _ in updates]
            scratch = self._scratch[acc.dtype]
            dt = acc.dtype
            top = np.finfo(dt).max
            for start in range(0, flat.size, BLOCK):
                stop = min(start + BLOCK, flat.size)
                out = flat[start:stop]
                tmp = scratch[: stop - start]
                first = 0
                if self.count == 0:
                    np.multiply(xs[0][start:stop], coeffs[0], out=out, dtype=dt,
                                casting="unsafe")
                    first = 1
                else:
                    np.multiply(out, keep, out=out)
                for x, c in zip(xs[first:], coeffs[first:], strict=True):
                    np.multiply(x[start:stop], c, out=tmp, dtype=dt, casting="unsafe")
                    np.add(out, tmp, out=out)
                if self.count or len(xs) > 1:
                    np.clip(out, -top, top, out=out)
        self.total_weight = total
        self.count += len(updates)

    def mean(self) -> dict[str, np.ndarray]:
        if self.count == 0 or not self._acc and self._dtypes:
            raise ValueError("no updates were added")
        out: dict[str, np.ndarray] = {}
        for name, acc in self._acc.items():
            if acc.size == 0:
                out[name] = np.zeros(acc.shape, self._dtypes[name])
                continue
            out[name] = cast_back(acc, self._dtypes[name])
        # The mean may share the accumulator's buffers: this sum is used up.
        self._acc = {}
        return out


def _scratch_or_new(reuse: Mapping[str, np.ndarray] | None, name: str,
                    shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    old = (reuse or {}).get(name)
    if (old is not None and old.shape == shape and old.dtype == dtype
            and old.flags.c_contiguous and old.flags.writeable):
        return old
    return np.empty(shape, dtype)


def weighted_mean(updates: list[tuple[Mapping[str, np.ndarray], float]]) -> dict[str, np.ndarray]:
    """The weighted mean of updates already in memory, in one blocked sweep."""
    if not updates:
        raise ValueError("no updates")
    acc = WeightedSum(updates[0][0])
    acc.add_many(updates)
    return acc.mean()


def weighted_metric(values: list[tuple[float, float]]) -> float | None:
    """Mean of (value, weight) pairs; None when there is nothing to average, or when the mean
    of finite values still overflows (documents hold no Infinity)."""
    total = sum(w for _, w in values)
    if total <= 0:
        return None
    # Weights normalised first: v * w alone overflows for large values and example counts.
    mean = sum(v * (w / total) for v, w in values)
    return mean if math.isfinite(mean) else None


# ---- server optimisers on the pseudo-gradient (Reddi et al., "Adaptive Federated
# Optimization", 2021). delta = mean of the updates - global model: the direction the
# nodes moved. Only floating tensors are optimised; integer ones (counters) take the mean.


def _floating(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def _pseudo_gradients(
    global_weights: Mapping[str, np.ndarray],
    mean: Mapping[str, np.ndarray],
    out: dict[str, np.ndarray],
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(name, global tensor, mean - global in the accumulation dtype) for every floating
    tensor; integer tensors (counters, indices) take the mean as it is, straight into `out`."""
    for name, avg in mean.items():
        g = global_weights[name]
        if not _floating(g.dtype):
            out[name] = np.array(avg)
            continue
        dt = acc_dtype(g.dtype)
        yield name, g, avg.astype(dt) - g.astype(dt)


def momentum_step(
    global_weights: Mapping[str, np.ndarray],
    mean: Mapping[str, np.ndarray],
    velocity: dict[str, np.ndarray],
    lr: float,
    momentum: float,
) -> dict[str, np.ndarray]:
    """FedAvgM: v <- momentum * v + delta; x <- x + lr * v. Updates `velocity` in place."""
    out: dict[str, np.ndarray] = {}
    for name, g, delta in _pseudo_gradients(global_weights, mean, out):
        v = velocity.get(name)
        if v is None:
            v = velocity[name] = np.zeros(g.shape, delta.dtype)
        v *= momentum
        v += delta
        out[name] = cast_back(g.astype(delta.dtype) + lr * v, g.dtype)
    return out


def adam_step(
    global_weights: Mapping[str, np.ndarray],
    mean: Mapping[str, np.ndarray],
    m: dict[str, np.ndarray],
    v: dict[str, np.ndarray],
    eta: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> dict[str, np.ndarray]:
    """FedAdam: m <- b1 m + (1-b1) d; v <- b2 v + (1-b2) d^2; x <- x + eta m / (sqrt(v) + tau).

    As in the paper (and Flower), no bias correction: tau bounds the first steps instead.
    Updates `m` and `v` in place.
    """
    out: dict[str, np.ndarray] = {}
    for name, g, delta in _pseudo_gradients(global_weights, mean, out):
        dt = delta.dtype
        mm = m.setdefault(name, np.zeros(g.shape, dt))
        vv = v.setdefault(name, np.zeros(g.shape, dt))
        mm *= beta1
        mm += (1 - beta1) * delta
        vv *= beta2
        vv += (1 - beta2) * np.square(delta)
        out[name] = cast_back(g.astype(dt) + eta * mm / (np.sqrt(vv) + tau), g.dtype)
    return out


# ---- robust statistics over a block of K stacked updates (shape (K, n)) -------------------


def coordinate_median(block: np.ndarray) -> np.ndarray:
    """Median of each column; for even K the mean of the two middle values. Sorts in place."""
    k = block.shape[0]
    if k == 0:
        raise ValueError("no updates")
    mid = k // 2
    kth = [mid - 1, mid] if k % 2 == 0 else [mid]
    block.partition(kth, axis=0)
    if k % 2:
        return block[mid].copy()
    # Halves first: the sum of two values near the dtype's largest overflows.
    return block[mid - 1] / 2 + block[mid] / 2


def trim_count(k: int, trim: float) -> int:
    """Updates removed from each end: floor(trim * K), always leaving at least one."""
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    return min(int(np.floor(trim * k)), (k - 1) // 2)


def trimmed_mean(block: np.ndarray, trim: float) -> np.ndarray:
    """Mean of each column without its floor(trim*K) smallest and largest values."""
    k = block.shape[0]
    if k == 0:
        raise ValueError("no updates")
    t = trim_count(k, trim)
    if t:
        block.partition([t - 1, k - t], axis=0)
    return safe_mean(block[t : k - t])


def safe_mean(block: np.ndarray) -> np.ndarray:
    """Column means that cannot overflow for finite values: float32 and narrower are summed
    in float64 (which K float32 values never overflow), float64 as a sum of x / K."""
    if block.dtype.itemsize < 8:
        return block.mean(axis=0, dtype=np.float64)
    top = np.finfo(block.dtype).max
    return np.clip((block / block.shape[0]).sum(axis=0), -top, top)
