"""Distributed differential privacy: a site's share of the noise under secure aggregation
(`[privacy] mode = "distributed"`).

Each site clips its change to the model (its floating-point values taken together) to an L2
norm of C = clip_norm and adds Gaussian noise of std z * C / sqrt(n_min) to every one of those
values, where n_min is the round's secure-aggregation threshold: the fewest inputs any sum the
aggregator can unmask contains (AggregatorSession.close_masked and SiteSession.unmask refuse
fewer). Every site weighs 1, so one site moves the sum by at most C, and a sum of m >= n_min
shares carries noise of std sqrt(m / n_min) * z * C >= z * C: the Gaussian mechanism with
multiplier at least z. That holds as long as n_min of the summed sites added their share
honestly; colluders beyond m - n_min lower it (docs/explanation/differential-privacy.md).

Integer tensors (BatchNorm's step counter) are no part of the private update: their change is
zeroed, so the global value is kept, as in central and local mode.

The noise comes from a generator seeded with 256 bits of os.urandom on the site, every round:
neither the aggregator nor anyone holding the job's seed can regenerate and subtract it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedgpu.core.privacy.mechanisms import is_private
from fedgpu.core.secagg.errors import SecAggError

# Values are drawn and scaled this many at a time: float temporaries stay small for any model.
_BLOCK = 1 << 20
# The quantisation range ([secure_aggregation] clip, per value) must hold a clipped value plus
# this many standard deviations of the share's noise: a value cut at the range's edge is a
# share that is no longer Gaussian. Beyond 6 sigma: about 2 values in a billion.
RANGE_SIGMAS = 6.0

Spans = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class NoiseShare:
    """What the aggregator asks of every site (TaskHeader.privacy_distributed)."""

    clip_norm: float
    noise_multiplier: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise SecAggError(f"distributed DP: clip_norm must be a positive number, got "
                              f"{self.clip_norm!r}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise SecAggError(f"distributed DP: noise_multiplier must be a number >= 0, got "
                              f"{self.noise_multiplier!r}")

    def std(self, n_min: int) -> float:
        """One site's noise std per value: z * C / sqrt(n_min)."""
        if n_min < 1:
            raise SecAggError(f"distributed DP: n_min must be >= 1, got {n_min}")
        return self.noise_multiplier * self.clip_norm / math.sqrt(n_min)

    def range_problem(self, value_clip: float, n_min: int) -> str | None:
        """Why a quantisation range of +-value_clip cannot carry the shares; None when it can."""
        need = self.clip_norm + RANGE_SIGMAS * self.std(n_min)
        if value_clip >= need:
            return None
        return (f"[secure_aggregation] clip = {value_clip:g} cuts the noise shares: with "
                f"[privacy] clip_norm = {self.clip_norm:g}, noise_multiplier = "
                f"{self.noise_multiplier:g} and threshold {n_min} each site's value can reach "
                f"clip_norm + {RANGE_SIGMAS:g} x its noise std = {need:.4g}; set "
                f"[secure_aggregation] clip to at least that")


@dataclass(frozen=True)
class ShareReport:
    # The update's L2 norm before clipping; whether it was clipped; the noise std per value.
    norm: float
    clipped: bool
    std: float
    # Values of the share outside the quantisation range (the round's checks make it ~0).
    cut: int


def private_spans(model: Mapping[str, np.ndarray]) -> tuple[tuple[int, int], ...]:
    """[start, stop) of each floating-point tensor in the flat layout (sorted names, as
    fedgpu/core/secagg/layout.py lays a model out)."""
    spans = []
    pos = 0
    for name in sorted(model):
        arr = model[name]
        n = int(np.prod(arr.shape, dtype=np.int64))
        if is_private(arr) and n:
            spans.append((pos, pos + n))
        pos += n
    return tuple(spans)


def csprng() -> np.random.Generator:
    """A generator seeded from the operating system's CSPRNG (256 bits), never from the job."""
    return np.random.Generator(np.random.PCG64(int.from_bytes(os.urandom(32), "big")))


def _blocks(spans: Spans) -> list[tuple[int, int]]:
    return [(a, min(a + _BLOCK, b)) for start, b in spans for a in range(start, b, _BLOCK)]


def add_share(change: np.ndarray, share: NoiseShare, n_min: int, value_clip: float,
              spans: Spans | None = None, rng: np.random.Generator | None = None,
              ) -> tuple[np.ndarray, ShareReport]:
    """The site's input to secure aggregation: `change` (flat) clipped to L2 norm clip_norm
    over `spans` (all of it when None), zero elsewhere, plus N(0, std^2) per value in `spans`.
    A new float32 vector; `change` is left as it was."""
    if change.ndim != 1:
        raise SecAggError("distributed DP takes a flat vector")
    blocks = _blocks(spans if spans is not None else [(0, change.size)])
    if blocks and (blocks[0][0] < 0 or max(b for _, b in blocks) > change.size):
        raise SecAggError("distributed DP: a private span lies outside the update")
    total = 0.0
    for a, b in blocks:
        part = np.asarray(change[a:b], dtype=np.float64)
        total += float(np.dot(part, part))
    norm = math.sqrt(total)
    if not math.isfinite(norm):
        raise SecAggError("the update holds a non-finite value; nothing was sent")
    factor = min(1.0, share.clip_norm / norm) if norm > 0 else 1.0
    if factor < 1.0:
        factor *= 1.0 - 1e-6  # float32 rounding must not land a hair above the clip
    std = share.std(n_min)
    rng = rng if rng is not None else csprng()
    out = np.zeros(change.size, dtype=np.float32)
    cut = 0
    for a, b in blocks:
        part = out[a:b]
        np.multiply(change[a:b], np.float32(factor), out=part, dtype=np.float32)
        if std > 0:
            noise = rng.standard_normal(b - a, dtype=np.float32)
            noise *= np.float32(std)
            part += noise
        cut += int(np.count_nonzero(np.abs(part) > value_clip))
    return out, ShareReport(norm, factor < 1.0, std, cut)


def submit_problem(value_clip: float, threshold: float | int, clip_norm: float,
                   noise_multiplier: float | None) -> str | None:
    """The quantisation range's problem, found at submit when it can be: with an absolute
    threshold (n_min is that count) and a given noise multiplier. A fractional threshold's
    n_min depends on the round's sites, and a derived multiplier on the job's start: those
    are checked when each round is planned (server/secagg/plan.py)."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or noise_multiplier is None:
        return None
    return NoiseShare(clip_norm, noise_multiplier).range_problem(value_clip, threshold)
