"""What the views show of an evaluate job (mode = "evaluate", server/rounds/scoring.py): the
model's metrics on each site's held-out split and weighted by examples, from the finished
round's `eval`. `fedgpu job status --json` has it as `evaluation`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedgpu.core.constants import RoundStatus


def summary(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """{loss, accuracy, num_examples, nodes, per_node: [{node, num_examples, metrics}]} of the
    finished evaluation round; None before it finished."""
    ev = next((r.get("eval") for r in reversed(rounds)
               if r.get("status") == RoundStatus.FINISHED and r.get("eval")), None)
    if not ev:
        return None
    per_node = sorted(({"node": e.get("node"), "node_id": e.get("node_id"),
                        "num_examples": e.get("num_examples"), "metrics": e.get("metrics")}
                       for e in ev.get("per_node") or ()), key=lambda e: str(e["node"]))
    return {"loss": ev.get("loss"), "accuracy": ev.get("accuracy"),
            "num_examples": ev.get("num_examples"), "nodes": ev.get("nodes"),
            "per_node": per_node}
