"""What leaves a site: a column's summary after suppression and optional noise.

Suppression (decided on the site, on exact counts): a column with fewer than `min_count`
records, or a histogram cell with fewer, is not sent at all (the column as `suppressed`, the
cell as None). A column lets one record give up to `per_record` values (a digits image gives
64 pixels), so the threshold is `min_count * per_record` values: a reported cell then holds
values of at least `min_count` different records. An empty cell is held back too: shown as 0,
it would tell that every held-back cell holds between 1 and min_count - 1 records.

Noise (optional, `noise = "laplace" | "gaussian"`): record-level differential privacy of the
released numbers. One record (added or removed) changes a column's count by at most k =
per_record, its shifted sum by k*h and shifted sum of squares by k*h^2 (h = half the range,
values clamped to it), and its histogram by k in L1 and L2. The site's `epsilon` is its whole
release's budget, split evenly over 4 releases per column (count, sum, sum of squares,
histogram) by basic composition. Gaussian uses the classic bound sigma = sensitivity *
sqrt(2 ln(1.25/delta)) / eps, valid for eps < 1 per release: a larger share is refused.

What noise does not cover: which cells and columns were suppressed (decided on exact counts),
and the column specs (the task's, public). Post-processing (clamping noisy counts at zero,
reading quantiles) keeps the guarantee.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from fedgpu.core.fedstats.columns import ColumnSpec, ColumnSummary

RELEASES_PER_COLUMN = 4
MAX_MIN_COUNT = 1_000_000


class Noise(StrEnum):
    NONE = "none"
    LAPLACE = "laplace"
    GAUSSIAN = "gaussian"


NOISES: tuple[str, ...] = tuple(n.value for n in Noise)


@dataclass(frozen=True)
class ReleaseSettings:
    """The job's `[statistics]` release settings, as a site applies them."""

    min_count: int = 10
    noise: Noise = Noise.NONE
    epsilon: float = 1.0
    delta: float = 1e-5

    def __post_init__(self) -> None:
        if not 1 <= self.min_count <= MAX_MIN_COUNT:
            raise ValueError(f"min_count must be 1..{MAX_MIN_COUNT}, got {self.min_count}")
        if self.noise not in NOISES:
            raise ValueError(f"noise must be one of {', '.join(NOISES)}, got {self.noise!r}")
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"epsilon must be a positive number, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")

    def share(self, columns: int) -> float:
        """Epsilon of one release of one column (basic composition over the site's release)."""
        return self.epsilon / (RELEASES_PER_COLUMN * max(columns, 1))

    def check(self, columns: int) -> None:
        """Refuse a Gaussian release whose per-release epsilon is outside the classic bound."""
        if self.noise == Noise.GAUSSIAN and self.share(columns) >= 1:
            raise ValueError(
                f"gaussian noise needs epsilon < 1 per release: epsilon {self.epsilon} over "
                f"{columns} column(s) x {RELEASES_PER_COLUMN} releases gives "
                f"{self.share(columns):g}; lower epsilon or use noise = \"laplace\"")


@dataclass(frozen=True)
class ColumnRelease:
    """One column as it leaves the site (wire.py writes it)."""

    spec: ColumnSpec
    suppressed: bool
    count: float | None = None
    shifted_sum: float | None = None
    shifted_sum_sq: float | None = None
    histogram: tuple[float | None, ...] = ()


def release(summaries: list[ColumnSummary], settings: ReleaseSettings,
            rng: np.random.Generator) -> list[ColumnRelease]:
    """The site's release of `summaries` under `settings`; `rng` draws the noise (seeded from
    the operating system outside tests: whoever knows the seed can subtract the noise)."""
    settings.check(len(summaries))
    eps = settings.share(len(summaries))
    return [_one(s, settings, eps, rng) for s in summaries]


def _one(s: ColumnSummary, settings: ReleaseSettings, eps: float,
         rng: np.random.Generator) -> ColumnRelease:
    spec = s.spec
    threshold = settings.min_count * spec.per_record
    if s.count < threshold:
        return ColumnRelease(spec=spec, suppressed=True)
    k, h = float(spec.per_record), (spec.hi - spec.lo) / 2

    def noisy(value: float, sensitivity: float) -> float:
        return value + _draw(settings, sensitivity, eps, rng, 1)[0]

    hist = np.array(s.histogram, dtype=np.float64)
    keep = hist >= threshold
    noise = _draw(settings, k, eps, rng, len(hist))
    cells = tuple(float(max(c + n, 0.0)) if ok else None
                  for c, n, ok in zip(hist, noise, keep, strict=True))
    return ColumnRelease(
        spec=spec, suppressed=False,
        count=max(noisy(s.count, k), 0.0),
        shifted_sum=noisy(s.shifted_sum, k * h),
        shifted_sum_sq=max(noisy(s.shifted_sum_sq, k * h * h), 0.0),
        histogram=cells,
    )


def _draw(settings: ReleaseSettings, sensitivity: float, eps: float,
          rng: np.random.Generator, n: int) -> np.ndarray:
    if settings.noise == Noise.LAPLACE:
        return rng.laplace(0.0, sensitivity / eps, n)
    if settings.noise == Noise.GAUSSIAN:
        sigma = sensitivity * math.sqrt(2 * math.log(1.25 / settings.delta)) / eps
        return rng.normal(0.0, sigma, n)
    return np.zeros(n)
