"""The per-site lines of an evaluate job's result (mode = "evaluate"): `fedgpu job status`
and `fedgpu run`'s summary print the same table of what each site measured."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedgpu.cli.common.output import fmt_value

# A terminal shows this many sites; the rest are counted (the --json document lists all).
SHOWN_SITES = 50


def site_lines(ev: Mapping[str, Any]) -> list[str]:
    """"site-a: accuracy 0.9100, loss 0.3012 on 180 examples" per site, then the weighted
    line, from an `evaluation` document (or a round's `eval`)."""
    per_node = sorted(ev.get("per_node") or (), key=lambda e: str(e.get("node")))
    lines = [f"  {e.get('node')}: {_metrics(e.get('metrics') or {})} on "
             f"{e.get('num_examples')} examples" for e in per_node[:SHOWN_SITES]]
    if len(per_node) > SHOWN_SITES:
        lines.append(f"  ... {len(per_node) - SHOWN_SITES} more sites (--json lists them)")
    lines.append(f"  weighted by examples: {_metrics(ev)} on {ev.get('num_examples')} "
                 f"examples of {ev.get('nodes')} sites")
    return lines


def _metrics(m: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {fmt_value(m.get(k))}" for k in ("accuracy", "loss")
                     if m.get(k) is not None) or "no metrics"
