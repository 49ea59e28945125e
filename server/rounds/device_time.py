"""Device time (GPU-hours) of a job: each accepted update's device-seconds (its training time
on each device it used, summed over a data-parallel round's workers), added up per site.

Read from the round history's documents (`fedgpu rounds --json` rounds), so a finished job's
saved history gives the same figures as a running job's. An update recorded before nodes
reported device-seconds counts its training time (one device).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def update_seconds(resources: Mapping[str, Any] | None) -> float:
    r = resources or {}
    return float(r.get("device_seconds") or r.get("train_seconds") or 0.0)


def per_site(rounds: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Device-seconds by site name, over every update of every round (retried rounds too:
    their training ran)."""
    sums: dict[str, float] = {}
    for rnd in rounds:
        for u in rnd.get("updates") or ():
            site = str(u.get("node") or u.get("node_id") or "?")
            sums[site] = sums.get(site, 0.0) + update_seconds(u.get("resources"))
    return {site: round(s, 3) for site, s in sorted(sums.items())}


def per_site_records(records: Iterable[Any]) -> dict[str, float]:
    """`per_site` from the history's RoundRecords themselves (a metrics scrape: no documents
    built)."""
    sums: dict[str, float] = {}
    for rec in records:
        for u in rec.updates:
            r = u.resources
            sums[u.node] = sums.get(u.node, 0.0) + float(r.device_seconds or r.train_seconds)
    return {site: round(s, 3) for site, s in sorted(sums.items())}


def summary(rounds: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """`{"total", "per_site": {site: seconds}}` in device-seconds, and the total in hours."""
    sites = per_site(rounds)
    total = round(sum(sites.values()), 3)
    return {"total": total, "hours": round(total / 3600, 4), "per_site": sites}
