"""Pure array math for aggregation: arrays in, arrays out, no server state."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from fedgpu.server.strategies.block_math import (
    blas_on_one_thread,
    block_norm,
    clamp,
    clamp_if_overflowed,
    fold,
    norm,
    sum_into,
)

Spec = Mapping[str, tuple[str, tuple[int, ...]]]

# Elements per block of the weighted sum (1 MiB of float32): the unit of the overflow bound
# and of one axpy call. Each update costs one read of x plus one read/write of the sum; the
# block keeps the Python per block (~1 us) to a few hundred calls per 11M-value update.
BLOCK = 1 << 18


def acc_dtype(dtype: np.dtype) -> np.dtype:
    # Half-precision sums lose digits fast; float32 is exact enough for averaging and
    # halves the memory of float64. Integers and float64 keep float64.
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize <= 4 or dtype.kind == "V" or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return np.dtype(np.float64)



def cast_back(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """An aggregate in its working dtype back to the model's dtype (integers rounded)."""
    if np.dtype(dtype).kind in "iub":
        values = np.rint(values)
    # No copy when the dtypes already agree (float32 models): the mean is the sum's buffer.
    return values.astype(dtype, copy=False)


class Normed(dict[str, np.ndarray]):
    """Tensors with an upper bound on each one's 2-norm, measured by the finite check that
    reads every value of an update anyway (server/validation.py): with it, WeightedSum knows
    before writing that an update cannot overflow the sum and needs no check of its own."""

    def __init__(self, tensors: Mapping[str, np.ndarray], norms: Mapping[str, float]) -> None:
        super().__init__(tensors)
        self.norms = dict(norms)


class WeightedSum:
    """Weighted mean of x_i with weights w_i, folded in as updates arrive: O(model) memory,
    any K, and no finite input (however large its values or its example count) overflows it.

    Fast path: S = sum (w_i / w_ref) x_i against a fixed reference weight (the first call's
    total), one fused multiply-add (BLAS axpy) per 1 MiB block and update, times w_ref / W in
    mean().
    Each block keeps a bound B >= |S| that grows by the norm of what is added (|a + b| <=
    |a| + |b|): known beforehand for Normed inputs and codec sources, else one dot product per
    block and input. A block stays fast while B < a quarter of the dtype's largest value, so S
    cannot overflow there; an add that would break that (huge values, weights 1e15 apart)
    turns that block, exactly and for good, into the running convex mean (what is there times
    W_old / W_new, each x_i times w_i / W_new, rounding past the dtype's largest value clamped
    back to it, where the exact mean lies). The bound is checked before the block is written
    (a block written for the first time is recomputed from its inputs), so the fallback never
    starts from a value that already overflowed.

    Inputs are arrays or block sources (fedgpu.core.update_codecs: int8 and top-k updates
    decoded block by block straight into the sum, never a full float copy of the update).
    """

    def __init__(self, like: Mapping[str, np.ndarray],
                 reuse: Mapping[str, np.ndarray] | None = None) -> None:
        self._dtypes = {k: np.dtype(v.dtype) for k, v in like.items()}
        # Uninitialised on purpose: the first add writes c * x straight into it, which saves
        # a pass over zeros the size of the model. `reuse`: arrays of an earlier sum nothing
        # uses any more, taken over where they fit (no page faults for a fresh model's worth).
        self._acc = {k: _scratch_or_new(reuse, k, v.shape, acc_dtype(v.dtype))
                     for k, v in like.items()}
        # Per dtype: a block of one input in the sum's dtype (int8 decoded, float16 widened).
        self._scratch = {dt: np.empty(BLOCK, dt)
                         for dt in {a.dtype for a in self._acc.values()}}
        # Per block: the bound on |S| (fast path), or NaN once the block holds the exact mean.
        self._bound = {k: np.zeros(-(-a.size // BLOCK)) for k, a in self._acc.items()}
        # Per tensor: the largest of its blocks' bounds (NaN if any is exact), so a streamed
        # update is checked against all of them in one comparison.
        self._top = dict.fromkeys(self._acc, 0.0)
        self.ref_weight = 0.0
        self.total_weight = 0.0
        self.count = 0
        self.exact_blocks = 0  # blocks that took the exact fallback

    def add(self, tensors: Mapping[str, Any], weight: float) -> None:
        self.add_many([(tensors, weight)])

    def add_many(self, updates: Sequence[tuple[Mapping[str, Any], float]]) -> None:
        """Fold in several updates in one sweep: K updates held in memory cost K reads of x
        and one read and write of the sum."""
        if not updates:
            return
        if not self._acc and self._dtypes:
            raise ValueError("this sum's mean() was already taken; start a new WeightedSum")
        for _, weight in updates:
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError(f"weight must be positive and finite, got {weight}")
        weights = [float(w) for _, w in updates]
        if self.count == 0:
            self.ref_weight = math.fsum(weights)  # one call (weighted_mean): S is the mean
        old = self.total_weight
        total = old + math.fsum(weights)
        fast_c = [w / self.ref_weight for w in weights]
        exact_c = [w / total for w in weights]
        # Overflow on the fast path is expected and handled (the block goes exact): numpy's
        # warnings about it would only be noise in the log.
        blas_on_one_thread()
        with np.errstate(over="ignore", invalid="ignore"):
            self._sweep(updates, fast_c, exact_c, old, total)
        self.total_weight = total
        self.count += len(updates)

    def _sweep(self, updates: Sequence[tuple[Mapping[str, Any], float]], fast_c: list[float],
               exact_c: list[float], old: float, total: float) -> None:
        fresh = self.count == 0
        for name, acc in self._acc.items():
            if acc.size == 0:
                continue
            flat = acc.reshape(-1)
            xs = [t[name] for t, _ in updates]
            tmp = self._scratch[acc.dtype]
            bounds = self._bound[name]
            limit = _limit(acc.dtype)
            # What this call adds to |S| when every input's norm is known (measured by
            # validation's finite check, or bounded by a codec's scales): no dot per block.
            norms = [_known_norm(t, name) for t, _ in updates]
            grow = (math.fsum(c * nx for c, nx in zip(fast_c, norms, strict=True))
                    if None not in norms else math.inf)
            top = 0.0 if fresh else self._top[name]
            if (len(xs) <= 2 and top + grow < limit
                    and all(isinstance(x, np.ndarray) and x.dtype == acc.dtype for x in xs)):
                # One update (as they stream in) or two, every block bounded: one pass over
                # the whole tensor, no Python per block. A NaN top (some block exact) fails.
                (sum_into if fresh else fold)(xs, fast_c, 0, flat.size, flat, tmp)
                if fresh:
                    bounds.fill(grow)
                else:
                    bounds += grow
                self._top[name] = top + grow
                continue
            for b, start in enumerate(range(0, flat.size, BLOCK)):
                stop = min(start + BLOCK, flat.size)
                out = flat[start:stop]
                n = stop - start
                base = 0.0 if fresh else bounds[b]  # NaN: the block is exact already
                if base + grow < limit:
                    # Bounded before it is written: one axpy per update.
                    if fresh:
                        sum_into(xs, fast_c, start, stop, out, tmp[:n])
                    else:
                        fold(xs, fast_c, start, stop, out, tmp[:n])
                    bounds[b] = base + grow
                    continue
                if fresh:
                    # Sum straight into the block, one check at the end, recompute if it broke.
                    sum_into(xs, fast_c, start, stop, out, tmp[:n])
                    bound = norm(out)
                    if bound < limit:
                        bounds[b] = bound
                        continue
                    sum_into(xs, exact_c, start, stop, out, tmp[:n])
                    clamp(out)
                elif not math.isnan(base):
                    # This call's norm bounded before anything lands in the block
                    # (|sum c x| <= sum c |x|, a dot per input), then the axpys.
                    bound = base + math.fsum(c * block_norm(x, start, stop, tmp[:n])
                                             for x, c in zip(xs, fast_c, strict=True))
                    if bound < limit:
                        fold(xs, fast_c, start, stop, out, tmp[:n])
                        bounds[b] = bound
                        continue
                    # Exact from here on: S * w_ref / W_new is the old mean's share of the new.
                    np.multiply(out, self.ref_weight / total, out=out)
                    fold(xs, exact_c, start, stop, out, tmp[:n])
                    clamp(out)
                else:
                    np.multiply(out, old / total, out=out)
                    fold(xs, exact_c, start, stop, out, tmp[:n])
                    clamp(out)
                self.exact_blocks += not math.isnan(base)
                bounds[b] = math.nan
            self._top[name] = float(bounds.max())  # NaN if any block is exact

    def mean(self, offset: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The weighted mean (plus `offset`, e.g. the global model under averaged deltas)."""
        if self.count == 0 or not self._acc and self._dtypes:
            raise ValueError("no updates were added")
        scale = self.ref_weight / self.total_weight
        out: dict[str, np.ndarray] = {}
        for name, acc in self._acc.items():
            if acc.size == 0:
                out[name] = np.zeros(acc.shape, self._dtypes[name])
                continue
            self._finish(acc.reshape(-1), self._bound[name], scale,
                         None if offset is None else np.asarray(offset[name]).reshape(-1))
            out[name] = cast_back(acc, self._dtypes[name])
        # The mean may share the accumulator's buffers: this sum is used up.
        self._acc = {}
        return out

    @staticmethod
    def _finish(flat: np.ndarray, bounds: np.ndarray, scale: float,
                offset: np.ndarray | None) -> None:
        if offset is None and not np.isnan(bounds).any():
            if scale != 1.0:  # every block holds S: one pass over the tensor to the mean
                np.multiply(flat, scale, out=flat)
            return
        # Block by block where an offset is added (the block is still in cache for the
        # check) or some blocks hold the exact mean already.
        for b, start in enumerate(range(0, flat.size, BLOCK)):
            block = flat[start:start + BLOCK]
            # Fast blocks hold S: one pass to the mean (scale <= 1, nothing can overflow).
            if not math.isnan(bounds[b]) and scale != 1.0:
                np.multiply(block, scale, out=block)
            if offset is not None:
                with np.errstate(over="ignore"):  # clamped just below
                    np.add(block, offset[start:start + BLOCK], out=block, casting="unsafe")
                clamp_if_overflowed(block)


@functools.cache
def _limit(dtype: np.dtype) -> float:
    return float(np.finfo(dtype).max) / 4


def _known_norm(tensors: Mapping[str, Any], name: str) -> float | None:
    """A bound on |tensors[name]| known without reading it, or None."""
    x = tensors[name]
    if not isinstance(x, np.ndarray):
        return float(x.norm_bound())
    if isinstance(tensors, Normed):
        return tensors.norms.get(name)
    return None


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


def pseudo_gradients(
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
    for name, g, delta in pseudo_gradients(global_weights, mean, out):
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
    for name, g, delta in pseudo_gradients(global_weights, mean, out):
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
