"""The client-level mechanisms on numpy arrays: an update's L2 norm and its clipping, Gaussian
noise, and adaptive clipping (Andrew et al. 2021). Pure functions of arrays and a generator.

An update is the local model minus the global model, over every floating-point tensor taken
together: clipping scales the whole update by one factor, so its direction is kept. Integer and
bool tensors (BatchNorm's step counter) are no part of the private update: the global value is
kept, since a node's count is itself a fact about its data.

Noise comes from a numpy Generator. The aggregator's and the node's generators draw their seed
from the operating system (`noise_generator()`); a fixed seed is for tests only: anyone who knows
the seed can subtract the noise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

Arrays = Mapping[str, np.ndarray]


def is_private(arr: np.ndarray) -> bool:
    """Whether a tensor takes part in the private update: floating point, numpy's or
    ml_dtypes' (bfloat16, float8), which numpy does not call floating."""
    return arr.dtype.kind == "f" or arr.dtype.name.startswith(("bfloat", "float8"))


def difference(local: Arrays, global_: Arrays) -> dict[str, np.ndarray]:
    """The update (local - global) in float32 per private tensor; names must match."""
    if set(local) != set(global_):
        missing = sorted(set(global_) ^ set(local))
        raise ValueError(f"the update and the global model name different tensors: {missing[:5]}")
    out: dict[str, np.ndarray] = {}
    for name, arr in local.items():
        if is_private(arr):
            out[name] = np.subtract(arr, global_[name], dtype=np.float32)
    return out


def apply_update(global_: Arrays, update: Arrays) -> dict[str, np.ndarray]:
    """global + update, in each tensor's own dtype; tensors without an update keep their value."""
    out: dict[str, np.ndarray] = {}
    for name, arr in global_.items():
        if name in update:
            out[name] = np.add(arr, update[name], dtype=np.float32).astype(arr.dtype, copy=False)
        else:
            out[name] = arr
    return out


def l2_norm(update: Arrays) -> float:
    """The L2 norm of all private tensors together, summed in float64 (a billion float32
    squares summed in float32 lose the small ones)."""
    total = 0.0
    for arr in update.values():
        if is_private(arr):
            flat = np.asarray(arr, dtype=np.float64).ravel()
            total += float(np.dot(flat, flat))
    return math.sqrt(total)


@dataclass(frozen=True)
class Clipped:
    update: dict[str, np.ndarray]
    # The norm before clipping, and the factor applied (1.0 when already within the clip).
    norm: float
    factor: float

    @property
    def was_clipped(self) -> bool:
        return self.factor < 1.0


def clip(update: Arrays, clip_norm: float) -> Clipped:
    """The update scaled so its L2 norm is at most `clip_norm` (float32 out)."""
    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError(f"clip_norm must be a positive finite number, got {clip_norm!r}")
    norm = l2_norm(update)
    if not math.isfinite(norm):
        raise ValueError("the update holds NaN or infinite values; it cannot be clipped")
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    # float32 rounding of arr * factor can land a hair above the clip; shave it off.
    if factor < 1.0:
        factor *= 1.0 - 1e-6
    out = {name: (np.multiply(arr, factor, dtype=np.float32) if factor < 1.0
                  else np.asarray(arr, dtype=np.float32))
           for name, arr in update.items() if is_private(arr)}
    return Clipped(out, norm, factor)


def clip_local(local: Arrays, global_: Arrays, clip_norm: float
               ) -> tuple[dict[str, np.ndarray], float]:
    """The local model with its update clipped: global + factor * (local - global) per
    private tensor (float32), the global value for the others; and the update's norm before.

    Works a tensor at a time: one model's worth of output, whatever the model's size (the
    aggregator does this for every update as it streams in).
    """
    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError(f"clip_norm must be a positive finite number, got {clip_norm!r}")
    total = 0.0
    for name, arr in local.items():
        if is_private(arr):
            d = np.subtract(arr, global_[name], dtype=np.float64).ravel()
            total += float(np.dot(d, d))
    norm = math.sqrt(total)
    if not math.isfinite(norm):
        raise ValueError("the update holds NaN or infinite values; it cannot be clipped")
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    if factor < 1.0:
        factor *= 1.0 - 1e-6  # float32 rounding must not land a hair above the clip
    out: dict[str, np.ndarray] = {}
    for name, g in global_.items():
        if not is_private(g):
            out[name] = g
            continue
        d = np.subtract(local[name], g, dtype=np.float32)
        if factor < 1.0:
            d *= np.float32(factor)
        d += g
        out[name] = d
    return out, norm


def noise_generator(seed: int | None = None) -> np.random.Generator:
    """A generator for the noise: seeded from the OS unless a (test) seed is given."""
    return np.random.default_rng(seed)


def add_gaussian_noise(arrays: Arrays, std: float, rng: np.random.Generator, *,
                       inplace: bool = False) -> dict[str, np.ndarray]:
    """Each private tensor plus independent N(0, std^2) noise per coordinate (float32 out).
    `inplace`: writeable float32 arrays take the noise where they are (an aggregate that
    nothing else holds), saving a model's worth of memory."""
    if not (std >= 0 and math.isfinite(std)):
        raise ValueError(f"the noise's standard deviation must be >= 0, got {std!r}")
    out: dict[str, np.ndarray] = {}
    for name, arr in arrays.items():
        if not is_private(arr):
            out[name] = arr
            continue
        if inplace and arr.dtype == np.float32 and arr.flags.writeable:
            noisy = arr
        else:
            noisy = np.array(arr, dtype=np.float32)
        if std > 0:
            # Drawn in float32 straight into a buffer: no float64 copy of a large model.
            noise = rng.standard_normal(noisy.shape, dtype=np.float32)
            noise *= np.float32(std)
            noisy += noise
        out[name] = noisy
    return out


def update_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """The noise multiplier left for the update when adaptive clipping's clipped-count takes
    its share (Andrew et al. 2021, Theorem 1): 1/z^2 = 1/z_update^2 + 1/(2 sigma_b)^2."""
    if noise_multiplier == 0:
        return 0.0
    if 2 * count_stddev <= noise_multiplier:
        raise ValueError(f"the clipped-count's noise ({count_stddev:g}) must be more than "
                         f"noise_multiplier / 2 ({noise_multiplier / 2:g})")
    return float((noise_multiplier ** -2 - (2 * count_stddev) ** -2) ** -0.5)


@dataclass(frozen=True)
class AdaptiveClip:
    """The clip of Andrew et al. 2021: after each round, C <- C * exp(-lr * (b - quantile)),
    where b is the noised fraction of the round's updates whose norm was at most C."""

    clip_norm: float
    target_quantile: float
    learning_rate: float
    # Std of the noise on the count of unclipped updates; None: sampled nodes / 20.
    count_stddev: float | None = None
    # The noised count of unclipped updates that made this clip (None: the first clip): the
    # only statistic of the norms that may be published, the exact count being unprotected.
    noised_unclipped: float | None = None

    def count_std_for(self, sampled: int) -> float:
        return self.count_stddev if self.count_stddev is not None else sampled / 20.0

    def next(self, norms: Iterable[float], rng: np.random.Generator) -> AdaptiveClip:
        """The clip for the next round, from this round's update norms (before clipping)."""
        values = list(norms)
        if not values:
            return self
        unclipped = sum(1 for n in values if n <= self.clip_norm)
        std = self.count_std_for(len(values))
        noised = unclipped + float(rng.normal(0.0, std))
        fraction = noised / len(values)
        clip_norm = self.clip_norm * math.exp(-self.learning_rate
                                              * (fraction - self.target_quantile))
        return replace(self, clip_norm=clip_norm, noised_unclipped=noised)
