"""Bounded views of the Admin documents for the dashboard: a page of sites, a summary of rounds.

`/api/nodes` and `/api/rounds` without parameters return the CLI's `--json` documents as they
are. Those grow with the federation (every site's devices; every update of every round), so the
page asks for these views instead: a page of sites with counts over all of them, and one small
record per round. With 1,000 sites a refresh then moves a few tens of KB, not megabytes.
Everything here is a pure function of the documents.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedgpu.server.views.link_view import link_summary, open_summary

DEFAULT_PAGE = 50
MAX_PAGE = 500
MAX_SEARCH = 200
# Rounds of per-site memory history sent with a page of sites (the rows' small charts).
MEMORY_ROUNDS = 20
DEFAULT_ROUNDS = 200
MAX_ROUNDS = 2000
# Time-budgeted rounds: each site's steps and examples are listed for the newest rounds only
# (the page's table shows 20), and for at most this many sites of each; older rounds and the
# sites beyond keep the spread (min, median, max), so a refresh stays small at 1,000 sites.
WORK_ROUNDS = 20
WORK_SITES = 100

NODE_PARAMS = frozenset({"offset", "limit", "q", "state"})
ROUND_PARAMS = frozenset({"summary", "last"})


class QueryError(ValueError):
    """A query parameter the endpoint cannot honour; the message says which and why."""


def _int_param(params: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise QueryError(f"{name} must be an integer, not {raw[:40]!r}") from None
    if not lo <= value <= hi:
        raise QueryError(f"{name} must be between {lo} and {hi}, not {value}")
    return value


def _unknown(params: Mapping[str, str], known: frozenset[str]) -> None:
    extra = sorted(set(params) - known)
    if extra:
        raise QueryError(f"unknown parameter {extra[0][:40]!r}; this endpoint takes "
                         + ", ".join(sorted(known)))


@dataclass(frozen=True)
class NodesQuery:
    offset: int = 0
    limit: int = DEFAULT_PAGE
    # Case-insensitive substring of the site's name.
    search: str = ""
    # A node state (`idle`, `training`, ..., `lost`); empty for all.
    state: str = ""

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> NodesQuery | None:
        """None when no paging parameter is given: the caller returns the whole document."""
        if not params:
            return None
        _unknown(params, NODE_PARAMS)
        search = params.get("q", "")
        if len(search) > MAX_SEARCH:
            raise QueryError(f"q is limited to {MAX_SEARCH} characters")
        return cls(offset=_int_param(params, "offset", 0, 0, 10**9),
                   limit=_int_param(params, "limit", DEFAULT_PAGE, 1, MAX_PAGE),
                   search=search.strip().lower(), state=params.get("state", "").strip()[:40])


@dataclass(frozen=True)
class RoundsQuery:
    last: int = DEFAULT_ROUNDS

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> RoundsQuery | None:
        """None without parameters: the caller returns the whole document."""
        if not params:
            return None
        _unknown(params, ROUND_PARAMS)
        if params.get("summary", "1") not in ("1", "true"):
            raise QueryError("summary takes 1 (the only view besides the whole document)")
        return cls(last=_int_param(params, "last", DEFAULT_ROUNDS, 1, MAX_ROUNDS))


def nodes_summary(nodes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts over every registered site, whatever page is shown."""
    devices: Counter[str] = Counter()
    for n in nodes:
        devices[(n.get("gpu_decision") or {}).get("device") or "unknown"] += 1
    return {
        "registered": len(nodes),
        "alive": sum(1 for n in nodes if n.get("alive")),
        "states": dict(sorted(Counter(str(n.get("state")) for n in nodes).items())),
        "devices": dict(sorted(devices.items())),
        "gpus": sum(len((n.get("devices") or {}).get("gpus") or ()) for n in nodes),
    }


def memory_history(rounds: Sequence[Mapping[str, Any]], names: set[str],
                   last: int = MEMORY_ROUNDS) -> dict[str, list[dict[str, Any]]]:
    """Per site (by name: a node's id changes when it re-registers), its updates' memory
    figures in the last `last` round records, oldest first."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rec in rounds[-last:]:
        for u in rec.get("updates") or ():
            series = out.get(u.get("node"))
            if series is None:
                continue
            res = u.get("resources") or {}
            series.append({
                "round": rec.get("round"),
                "device": res.get("device"),
                "before": res.get("nvml_used_before_mib"),
                "peak": res.get("nvml_used_peak_mib"),
                "after": res.get("nvml_used_after_mib"),
                "rss_peak": res.get("rss_peak_mib"),
            })
    return out


def nodes_page(doc: Mapping[str, Any], rounds: Sequence[Mapping[str, Any]],
               query: NodesQuery) -> dict[str, Any]:
    """One page of `fedgpu nodes --json`'s records (each with its `memory_history`), the
    number that match, and a summary of all of them."""
    nodes = list(doc.get("nodes") or ())
    matching = [n for n in nodes
                if (not query.search or query.search in str(n.get("name", "")).lower())
                and (not query.state or n.get("state") == query.state)]
    page = matching[query.offset:query.offset + query.limit]
    history = memory_history(rounds, {str(n.get("name")) for n in page})
    return {
        "nodes": [{**n, "memory_history": history[str(n.get("name"))]} for n in page],
        "total": len(matching),
        "offset": query.offset,
        "limit": query.limit,
        "summary": nodes_summary(nodes),
    }


def _eval(ev: Mapping[str, Any] | None, per_site: bool = False) -> dict[str, Any] | None:
    """A round's federated evaluation; `per_site`: with each site's own metrics (the first
    WORK_SITES by name: an evaluate job's result is its one round's sites)."""
    if not ev:
        return None
    out = {"loss": ev.get("loss"), "accuracy": ev.get("accuracy"), "nodes": ev.get("nodes")}
    if per_site:
        sites = sorted(({"node": str(e.get("node", "")), "num_examples": e.get("num_examples"),
                         "loss": (e.get("metrics") or {}).get("loss"),
                         "accuracy": (e.get("metrics") or {}).get("accuracy")}
                        for e in ev.get("per_node") or ()), key=lambda x: x["node"])
        out["sites"] = sites[:WORK_SITES]
        out["sites_not_listed"] = len(sites) - len(out["sites"])
    return out


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def secure_summary(sa: Mapping[str, Any] | None,
                   sums: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """A secure round's `secure_aggregation` (server/secagg/driver.py) with the dropped
    sites counted by stage instead of named, and the sums of the sites' masked training
    numbers (`sums`: the record's `masked_metrics`)."""
    if not sa:
        return None
    return {
        "sums": {k: v.get("value") for k, v in (sums or {}).items()} or None,
        "sites": sa.get("sites"), "masked": sa.get("masked"),
        "dropped": {str(stage): len(names) for stage, names in (sa.get("dropped") or {}).items()},
        "recovered": sa.get("recovered"), "protocol_s": sa.get("protocol_s"),
        "unmask_s": sa.get("unmask_s"), "ring_bits": sa.get("ring_bits"),
        "failed": sa.get("failed"),
    }


def work_summary(rec: Mapping[str, Any], per_site: bool) -> dict[str, Any] | None:
    """A time-budgeted round's (`round_train_s` set, local_work = "time") steps and examples
    per site, from its updates' train metrics; None for other rounds."""
    budget = rec.get("round_train_s")
    if budget is None:
        return None
    sites = []
    for u in rec.get("updates") or ():
        m = u.get("train_metrics") or {}
        steps, examples = m.get("steps"), m.get("examples")
        sites.append({"node": str(u.get("node", "")),
                      "steps": None if steps is None else int(steps),
                      "examples": None if examples is None else int(examples)})
    sites.sort(key=lambda x: x["node"])
    listed = sites[:WORK_SITES] if per_site else []
    return {
        "budget_s": budget,
        "steps": _spread([x["steps"] for x in sites if x["steps"] is not None]),
        "examples": _spread([x["examples"] for x in sites if x["examples"] is not None]),
        "sites": listed,
        "sites_not_listed": len(sites) - len(listed),
    }


def round_summary(rec: Mapping[str, Any], per_site: bool = True,
                  eval_sites: bool = False) -> dict[str, Any]:
    """One round record of `fedgpu rounds --json` without its per-update lists: counts,
    losses and the upload times' max and median; a secure round's protocol figures and a
    time-budgeted round's work per site (`per_site` False: its spread only)."""
    uploads = [u["upload_s"] for u in rec.get("updates") or () if u.get("upload_s") is not None]
    rejected = Counter(str(r.get("reason")) for r in rec.get("rejected") or ())
    return {
        "round": rec.get("round"),
        "attempt": rec.get("attempt"),
        "status": rec.get("status"),
        "started_at": rec.get("started_at"),
        "duration_s": rec.get("duration_s"),
        "participants": len(rec.get("participants") or ()),
        "nodes_reporting": rec.get("nodes_reporting"),
        "dropped": len(rec.get("dropped") or ()),
        "train_loss": rec.get("train_loss"),
        "num_examples": rec.get("num_examples"),
        "bytes_received": rec.get("bytes_received"),
        "aggregation_s": rec.get("aggregation_s"),
        "upload_s": None if not uploads else {"max": max(uploads),
                                               "median": statistics.median(uploads)},
        "rejected": dict(sorted(rejected.items())),
        "failures": len(rec.get("failures") or ()),
        "eval": _eval(rec.get("eval"), eval_sites),
        # [privacy]: the epsilon spent after this round (server/strategies/private.py).
        "epsilon": (rec.get("privacy") or {}).get("epsilon"),
        "secure_aggregation": secure_summary(rec.get("secure_aggregation"),
                                             rec.get("masked_metrics")),
        "work": work_summary(rec, per_site),
        # Sites left out for a slow link, or asked to compress (server/views/link_view.py).
        "link": link_summary(rec),
    }


def rounds_summary(doc: Mapping[str, Any], query: RoundsQuery) -> dict[str, Any]:
    rounds = list(doc.get("rounds") or ())
    shown = rounds[-query.last:]
    return {
        "run_id": doc.get("run_id"),
        "initial_eval": _eval(doc.get("initial_eval")),
        "total": len(rounds),
        # Each site's evaluation for the latest round only (an evaluate job's one round).
        "rounds": [round_summary(r, per_site=i >= len(shown) - WORK_ROUNDS,
                                 eval_sites=i == len(shown) - 1)
                   for i, r in enumerate(shown)],
        # GPU-hours of the whole job (every round, not only those shown), per site.
        "device_seconds": doc.get("device_seconds"),
        # While a round is open: each site's transfer progress.
        **({"open": progress} if (progress := open_summary(doc)) else {}),
    }
