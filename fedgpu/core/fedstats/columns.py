"""A column of a site's data and its summary: the numbers every other figure is derived from.

A site sends, per column, the count, the sum and the sum of squares of (value - centre) and a
histogram over fixed edges. Centre, edges and range come from the column's spec, which the task
declares, so every site bins on the same edges and histograms merge by adding cells. Shifting
by the range's centre keeps the sum of squares small (no cancellation when the mean is far
from zero) and bounds what one record can change it by (the noise's sensitivity, release.py).

Values outside [lo, hi] are clamped to the range before anything is computed: the histogram's
end cells hold them, and the noise's sensitivity is a fact about the range, not the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_BINS = 1000
MAX_PER_RECORD = 1 << 24


@dataclass(frozen=True)
class ColumnSpec:
    """What one column is: its name, value range, number of histogram bins, and how many
    values one record contributes at most (a digits image gives 64 pixels)."""

    name: str
    lo: float
    hi: float
    bins: int
    per_record: int = 1

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 128:
            raise ValueError(f"a column name must be 1-128 characters, got {self.name!r}")
        if not (math.isfinite(self.lo) and math.isfinite(self.hi) and self.lo < self.hi):
            raise ValueError(f"column {self.name!r}: range [{self.lo}, {self.hi}] must be finite "
                             "with lo < hi")
        if not 1 <= self.bins <= MAX_BINS:
            raise ValueError(f"column {self.name!r}: bins must be 1..{MAX_BINS}, got {self.bins}")
        if not 1 <= self.per_record <= MAX_PER_RECORD:
            raise ValueError(f"column {self.name!r}: per_record must be 1..{MAX_PER_RECORD}, "
                             f"got {self.per_record}")

    @property
    def centre(self) -> float:
        return (self.lo + self.hi) / 2

    @property
    def width(self) -> float:
        """One bin's width: the error bound of a quantile read from the histogram."""
        return (self.hi - self.lo) / self.bins

    def edges(self) -> np.ndarray:
        return np.linspace(self.lo, self.hi, self.bins + 1)


@dataclass(frozen=True)
class ColumnSummary:
    """A site's column before release: exact, never sent as is when noise or suppression
    applies (release.py decides what leaves)."""

    spec: ColumnSpec
    count: float
    shifted_sum: float      # sum of (value - centre)
    shifted_sum_sq: float   # sum of (value - centre)^2
    histogram: tuple[float, ...]


def summarize(spec: ColumnSpec, values: np.ndarray) -> ColumnSummary:
    """The summary of `values` (any shape; flattened) under `spec`, values clamped to its range.

    NaN values are refused: a column with holes needs a decision (drop, impute) that is the
    task's, not ours.
    """
    flat = np.asarray(values, dtype=np.float64).ravel()
    if np.isnan(flat).any():
        raise ValueError(f"column {spec.name!r} holds NaN values; drop or fill them in the task's "
                         "statistics()")
    clamped = np.clip(flat, spec.lo, spec.hi)
    shifted = clamped - spec.centre
    hist, _ = np.histogram(clamped, bins=spec.bins, range=(spec.lo, spec.hi))
    return ColumnSummary(spec=spec, count=float(flat.size), shifted_sum=float(shifted.sum()),
                         shifted_sum_sq=float(np.dot(shifted, shifted)),
                         histogram=tuple(float(c) for c in hist))


def quantiles(spec: ColumnSpec, histogram: list[float | None], qs: tuple[float, ...]
              ) -> dict[str, float | None]:
    """Quantiles read from a histogram, linear within a bin: each is within one bin width of
    the quantile of the values the histogram counts (suppressed cells, None, count as empty).
    None for every q when the histogram counts nothing."""
    counts = np.array([max(c or 0.0, 0.0) for c in histogram], dtype=np.float64)
    total = counts.sum()
    out: dict[str, float | None] = {}
    if total <= 0:
        return {_qname(q): None for q in qs}
    cum = np.cumsum(counts)
    edges = spec.edges()
    for q in qs:
        target = q * total
        i = int(np.searchsorted(cum, target, side="left"))
        i = min(i, len(counts) - 1)
        before = cum[i] - counts[i]
        frac = 0.0 if counts[i] <= 0 else min(max((target - before) / counts[i], 0.0), 1.0)
        out[_qname(q)] = float(edges[i] + frac * (edges[i + 1] - edges[i]))
    return out


def _qname(q: float) -> str:
    """0.5 -> "p50", 0.025 -> "p2.5": the keys of the quantiles in every document."""
    return f"p{q * 100:g}"


def summary_to_dict(s: ColumnSummary) -> dict[str, object]:
    """A summary as the round's worker writes it to result.json, for its agent (on the site:
    this is the exact summary, before release)."""
    return {"name": s.spec.name, "lo": s.spec.lo, "hi": s.spec.hi, "bins": s.spec.bins,
            "per_record": s.spec.per_record, "count": s.count, "sum": s.shifted_sum,
            "sum_sq": s.shifted_sum_sq, "histogram": list(s.histogram)}


def summary_from_dict(d: object) -> ColumnSummary:
    """The worker's summary read back by the agent; ValueError when it is not one."""
    try:
        assert isinstance(d, dict)
        spec = ColumnSpec(name=str(d["name"]), lo=float(d["lo"]), hi=float(d["hi"]),
                          bins=int(d["bins"]), per_record=int(d["per_record"]))
        hist = tuple(float(c) for c in d["histogram"])
        out = ColumnSummary(spec=spec, count=float(d["count"]), shifted_sum=float(d["sum"]),
                            shifted_sum_sq=float(d["sum_sq"]), histogram=hist)
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a column summary: {exc!r}") from None
    if len(hist) != spec.bins:
        raise ValueError(f"column {spec.name!r}: {len(hist)} histogram cells for {spec.bins} bins")
    return out
