"""A statistics job's figures as text (`fedgpu job status`, `fedgpu run`): one line per column
and site, the combined figures first, from the "statistics" document of `job status --json`."""

from __future__ import annotations

from typing import Any

_QUANTILES = ("p5", "p25", "p50", "p75", "p95")


def _num(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.4g}"
    return f"{int(v):,}" if isinstance(v, int | float) else str(v)


def statistics_lines(doc: dict[str, Any] | None) -> list[str]:
    """Empty for a job without statistics (yet)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("combined"), dict):
        return []
    rel = doc.get("release") or {}
    sites = doc.get("sites") or {}
    noise = rel.get("noise", "none")
    noise_text = noise if noise == "none" else f"{noise}, epsilon {rel.get('epsilon'):g} per site"
    lines = [f"statistics of {len(sites)} site(s) (min_count {rel.get('min_count')}, noise "
             f"{noise_text}); quantiles from {doc.get('quantiles_from', 'histograms')}"]
    head = ["column", "site", "count", "mean", "std", "min", *_QUANTILES, "max", "held back"]
    rows = [head]
    for name, col in doc["combined"].items():
        held = sum(col.get("suppressed_cells") or [])
        whole = len(col.get("suppressed_sites") or [])
        note = f"{held} cell(s)" + (f", {whole} site(s) whole" if whole else "")
        rows.append(_row(name, "combined", col, note))
        for site, cols in sites.items():
            c = cols.get(name)
            if c is None:
                continue
            if c.get("suppressed"):
                rows.append([name, site, "held back", *["-"] * (len(head) - 4), "whole column"])
            else:
                rows.append(_row(name, site, c, f"{sum(v is None for v in c['histogram'])} "
                                 "cell(s)"))
        for site, why in (col.get("excluded") or {}).items():
            rows.append([name, site, "left out", *["-"] * (len(head) - 4), why])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    return lines


def _row(name: str, site: str, c: dict[str, Any], note: str) -> list[str]:
    q = c.get("quantiles") or {}
    return [name, site, _num(c.get("count")), _num(c.get("mean")), _num(c.get("std")),
            _num(c.get("min")), *(_num(q.get(k)) for k in _QUANTILES), _num(c.get("max")), note]
