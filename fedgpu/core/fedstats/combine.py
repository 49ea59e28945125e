"""Per-site and combined figures from the sites' releases (the aggregator's side).

Combined count, mean and standard deviation are exact (up to float rounding) without noise:
counts and shifted sums add, and mean = centre + sum/count, variance = sum_sq/count - (sum/
count)^2 (population, numpy's ddof=0). Combined histograms add cell by cell the cells sites
reported; a cell a site suppressed is never seen, so the combined histogram, quantiles and
min/max describe the reported cells only (`suppressed_cells` counts, per cell, the sites that
held one back). Quantiles are read from the merged histogram: within one bin width of the
quantiles of the values it counts. Min and max are bin edges: the lower edge of the lowest and
the upper edge of the highest reported non-empty cell (an exact minimum would be one record's
value).

A site whose column spec differs from the first site's (another range or bins: another task
version) is left out of that column's combination, with the reason.
"""

from __future__ import annotations

import math
from typing import Any

from fedgpu.core.fedstats.columns import ColumnSpec, quantiles
from fedgpu.core.fedstats.release import ColumnRelease

QUANTILES: tuple[float, ...] = (0.05, 0.25, 0.5, 0.75, 0.95)


def figures(spec: ColumnSpec, count: float, shifted_sum: float, shifted_sum_sq: float,
            histogram: list[float | None]) -> dict[str, Any]:
    """The reported figures of one column from its sums and histogram."""
    if count <= 0:
        mean = std = None
    else:
        m = shifted_sum / count
        mean = spec.centre + m
        std = math.sqrt(max(shifted_sum_sq / count - m * m, 0.0))
    edges = spec.edges()
    filled = [i for i, c in enumerate(histogram) if c]
    return {
        "count": count, "mean": mean, "std": std,
        "min": float(edges[filled[0]]) if filled else None,
        "max": float(edges[filled[-1] + 1]) if filled else None,
        "quantiles": quantiles(spec, histogram, QUANTILES),
        "histogram": histogram,
        "edges": [float(e) for e in edges],
    }


def combine(sites: dict[str, list[ColumnRelease]]) -> dict[str, Any]:
    """{"sites": {site: {column: figures | {"suppressed": true}}}, "combined": {column:
    figures + sites, suppressed_sites, suppressed_cells, excluded}} for the sites' releases."""
    per_site: dict[str, dict[str, Any]] = {}
    specs: dict[str, ColumnSpec] = {}
    for site, cols in sites.items():
        per_site[site] = {}
        for c in cols:
            specs.setdefault(c.spec.name, c.spec)
            if c.suppressed:
                per_site[site][c.spec.name] = {"suppressed": True}
            else:
                per_site[site][c.spec.name] = figures(
                    c.spec, c.count or 0.0, c.shifted_sum or 0.0, c.shifted_sum_sq or 0.0,
                    list(c.histogram))
    combined: dict[str, Any] = {}
    for name, spec in specs.items():
        count = s1 = s2 = 0.0
        hist: list[float | None] = [None] * spec.bins
        held_back = [0] * spec.bins
        used, suppressed, excluded = [], [], {}
        for site, cols in sites.items():
            c = next((c for c in cols if c.spec.name == name), None)
            if c is None:
                continue
            if c.spec != spec:
                excluded[site] = (f"spec differs: range [{c.spec.lo}, {c.spec.hi}] in "
                                  f"{c.spec.bins} bins, expected [{spec.lo}, {spec.hi}] in "
                                  f"{spec.bins}")
                continue
            if c.suppressed:
                suppressed.append(site)
                continue
            used.append(site)
            count += c.count or 0.0
            s1 += c.shifted_sum or 0.0
            s2 += c.shifted_sum_sq or 0.0
            for i, cell in enumerate(c.histogram):
                if cell is None:
                    held_back[i] += 1
                else:
                    hist[i] = (hist[i] or 0.0) + cell
        doc = figures(spec, count, s1, s2, hist) if used else {"count": 0.0}
        doc.update(sites=used, suppressed_sites=suppressed, suppressed_cells=held_back,
                   excluded=excluded, bin_width=spec.width)
        combined[name] = doc
    return {"sites": per_site, "combined": combined,
            "quantiles_from": "merged histograms (error at most one bin width)"}
