"""What a job's rounds document (`fedgpu rounds --json`) says as tracking metrics: pure, so the
mapping is tested without a tracking store.

Metrics of a round are logged at step = its round number, from the attempt that finished it
(a retried attempt is not a step of the model). Per-site metrics are named `site.<name>.<key>`;
under secure aggregation the aggregator has none, and none are invented.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

Point = tuple[str, float, int]  # (key, value, step)

# MLflow keys: letters, digits, underscores, dashes, periods, spaces and slashes.
_UNSAFE = re.compile(r"[^\w\-. /]")
# A round's own numbers, besides its evaluation.
_ROUND_KEYS = ("train_loss", "duration_s", "num_examples", "nodes_reporting", "bytes_received",
               "aggregation_s")
_RESOURCE_KEYS = {"nvml_used_peak_mib": "gpu_peak_mib", "rss_peak_mib": "rss_peak_mib",
                  "train_seconds": "train_seconds"}


def key(*parts: str) -> str:
    return ".".join(_UNSAFE.sub("_", p) for p in parts)[:250]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _eval(summary: Mapping[str, Any] | None, step: int) -> Iterator[Point]:
    if not summary:
        return
    for name in ("loss", "accuracy"):
        value = _number(summary.get(name))
        if value is not None:
            yield key(f"eval_{name}"), value, step
    for site in summary.get("per_node") or []:
        for name, value in (site.get("metrics") or {}).items():
            number = _number(value)
            if number is not None:
                yield key("site", str(site.get("node") or site.get("node_id")),
                          f"eval_{name}"), number, step


def points(doc: Mapping[str, Any]) -> list[Point]:
    """Every metric the document holds, one point per (key, step)."""
    out: list[Point] = list(_eval(doc.get("initial_eval"), 0))
    for rec in doc.get("rounds") or []:
        if rec.get("status") != "finished":
            continue
        step = int(rec["round"])
        for name in _ROUND_KEYS:
            value = _number(rec.get(name))
            if value is not None:
                out.append((key(name), value, step))
        spent = _number((rec.get("privacy") or {}).get("epsilon"))
        if spent is not None:
            out.append((key("epsilon"), spent, step))
        for update in rec.get("updates") or []:
            site = str(update.get("node") or update.get("node_id"))
            loss = _number((update.get("train_metrics") or {}).get("loss"))
            if loss is not None:
                out.append((key("site", site, "train_loss"), loss, step))
            for field, name in _RESOURCE_KEYS.items():
                value = _number((update.get("resources") or {}).get(field))
                if value is not None:
                    out.append((key("site", site, name), value, step))
        out.extend(_eval(rec.get("eval"), step))
    return out


def params(job: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A job's settings as flat MLflow parameters (`privacy.target_epsilon`); values cut to
    MLflow's 6,000 characters, unset ones left out."""
    out: dict[str, str] = {}
    for name, value in job.items():
        full = f"{prefix}{name}"
        if isinstance(value, Mapping):
            out.update(params(value, f"{full}."))
        elif value is not None:
            out[key(full)] = str(value)[:6000]
    return out
