"""The site x model matrix of a cross-site job (mode = "cross-site", server/rounds/cross_site.py),
read from its round records: pure, so the aggregator's views (`fedgpu job status --json`
has it as `cross_site`, the dashboard's job view draws it) and `fedgpu report` (from a rounds
document or a state directory) build the same one.

Rows are models: the training job's final model ("global"), then each site's local model by
site name (sent or not); columns are the sites whose held-out data scored them. A row whose
model did not come says why (`why_not`: the site's policy, no model kept, no answer); a cell
a site did not score says why too (its failure or refusal in that round, or no answer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedgpu.core.constants import RoundStatus

KEY = "cross_site"  # as server/rounds/cross_site.py writes it into each round record
GLOBAL = "global"
NOT_SCORED = "no score by the round's deadline"


def _score(entry: Mapping[str, Any]) -> dict[str, Any]:
    metrics = entry.get("metrics") or {}
    return {"accuracy": metrics.get("accuracy"), "loss": metrics.get("loss"),
            "num_examples": entry.get("num_examples")}


def _why_missing(rec: Mapping[str, Any]) -> dict[str, str]:
    out = {f.get("node"): f.get("error") or "failed" for f in rec.get("failures") or ()}
    out.update({i.get("node"): i.get("reason") for i in rec.get("ineligible") or ()})
    return {str(k): str(v) for k, v in out.items() if k}


def matrix(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """{of_job, sites, rows: [{model, round, why_not, weighted, cells: {site: score or
    {why_not}}}]}; None before the collection round closed."""
    collect = next((r for r in rounds if (r.get(KEY) or {}).get("stage") == "collect"), None)
    if collect is None:
        return None
    info = collect[KEY]
    not_sent: dict[str, str] = dict(info.get("not_sent") or {})
    scored: dict[str, Mapping[str, Any]] = {}
    for rec in rounds:  # the finished attempt of each model's round (the last one wins)
        part = rec.get(KEY) or {}
        if part.get("stage") == "score" and rec.get("status") == RoundStatus.FINISHED:
            scored[str(part.get("model"))] = rec
    sites = set(info.get("sent") or ()) | set(not_sent)
    for rec in scored.values():
        sites |= {str(e.get("node")) for e in (rec.get("eval") or {}).get("per_node") or ()}
    columns = sorted(sites)
    rows = []
    for model in [GLOBAL, *sorted(set(info.get("sent") or ()) | set(not_sent))]:
        rec = scored.get(model)
        row: dict[str, Any] = {"model": model, "round": rec.get("round") if rec else None,
                               "why_not": None, "weighted": None, "cells": {}}
        if rec is None:
            row["why_not"] = not_sent.get(model) or "not scored (the job ended first)"
            rows.append(row)
            continue
        ev = rec.get("eval") or {}
        row["weighted"] = {"accuracy": ev.get("accuracy"), "loss": ev.get("loss"),
                           "num_examples": ev.get("num_examples")}
        got = {str(e.get("node")): _score(e) for e in ev.get("per_node") or ()}
        missing = _why_missing(rec)
        row["cells"] = {site: got.get(site) or {"why_not": missing.get(site, NOT_SCORED)}
                        for site in columns}
        rows.append(row)
    return {"of_job": info.get("of_job"), "sites": columns, "rows": rows,
            "not_sent": not_sent}
