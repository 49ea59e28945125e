"""Clipping, quantisation into Z_2^bits and back: how float updates become ring elements.

A site's update x (a flat float vector) is clipped to [-clip, clip] and scaled to integers in
[-L, L], L = 2^(bits-1) - 1, rounded stochastically (unbiased: E[q] = x * L / clip) or to the
nearest integer. It is then multiplied by the site's integer weight w and the weight itself is
appended, both as two's-complement elements of Z_2^ring_bits: the aggregator's unmasked sum
is (sum of w_i q_i, sum of w_i), which gives weighted FedAvg without any single weight leaving a
site. The sum is exact in the ring as long as sites * max_weight * L < 2^(ring_bits - 1)
(RoundParams checks it), so the only error is rounding: per coordinate of the mean at most
clip / L with stochastic rounding, clip / (2 L) with nearest rounding (`error_bound`).
"""

from __future__ import annotations

import math

import numpy as np

from fedgpu.core.secagg.errors import SecAggError
from fedgpu.core.secagg.prg import BLOCK_ELEMENTS, ring_dtype


def levels(bits: int) -> int:
    """L: the largest quantised magnitude."""
    return (1 << (bits - 1)) - 1


def error_bound(clip: float, bits: int, stochastic: bool) -> float:
    """The largest difference, per coordinate, between the unmasked mean and the plain weighted
    mean of the clipped updates (float32 rounding of the result aside)."""
    step = clip / levels(bits)
    return step if stochastic else step / 2


def site_weight(weight: float, max_weight: int) -> int:
    """The integer weight a site contributes: rounded, at most `max_weight`."""
    if not math.isfinite(weight) or weight < 0:
        raise SecAggError(f"a site's weight must be a finite number >= 0, got {weight}")
    return min(int(round(weight)), max_weight)


def encode(update: np.ndarray, weight: int, clip: float, bits: int, ring_bits: int,
           rng: np.random.Generator | None, extra: np.ndarray | None = None) -> np.ndarray:
    """[w * q(update), w, extra] in Z_2^ring_bits (`extra`: ring elements appended as they
    are); `rng` None rounds to nearest. Works block by block, so float64 temporaries stay one
    block whatever the model's size."""
    if update.ndim != 1:
        raise SecAggError("quantisation takes a flat vector")
    dtype = ring_dtype(ring_bits)
    signed = np.dtype(f"<i{dtype.itemsize}")
    tail = 0 if extra is None else extra.size
    out = np.empty(update.size + 1 + tail, dtype=dtype)
    scale = levels(bits) / clip
    w = np.array(weight, dtype=dtype)
    for start in range(0, update.size, BLOCK_ELEMENTS):
        block = np.asarray(update[start:start + BLOCK_ELEMENTS], dtype=np.float64)
        if not np.all(np.isfinite(block)):
            raise SecAggError("the update holds a non-finite value; nothing was sent")
        scaled = np.clip(block, -clip, clip) * scale
        if rng is None:
            q = np.rint(scaled)
        else:
            q = np.floor(scaled + rng.random(scaled.size))
        part = out[start:start + block.size]
        # Two's complement: -3 becomes 2^ring_bits - 3, and sums wrap the same way.
        part[:] = q.astype(signed).view(dtype)
        np.multiply(part, w, out=part)
    out[update.size] = weight
    if extra is not None:
        out[update.size + 1:] = extra
    return out


def decode_sum(total: np.ndarray, clip: float, bits: int) -> tuple[np.ndarray, int]:
    """(weighted mean as float32, total weight) from the unmasked [sum w q, sum w]."""
    if total.ndim != 1 or total.dtype.kind != "u" or total.size < 1:
        raise SecAggError("an unmasked sum is a flat vector of ring elements")
    signed = total.view(f"<i{total.dtype.itemsize}")
    weight = int(signed[-1])
    if weight <= 0:
        raise SecAggError(f"the surviving sites' total weight is {weight}; nothing to average")
    factor = clip / levels(bits) / weight
    mean = np.empty(total.size - 1, dtype=np.float32)
    for start in range(0, mean.size, BLOCK_ELEMENTS):
        mean[start:start + BLOCK_ELEMENTS] = (
            signed[start:min(start + BLOCK_ELEMENTS, mean.size)].astype(np.float64) * factor)
    return mean, weight
