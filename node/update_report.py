"""A task's answer as the node sends it: the update header built from the round's outcome
(metrics, resources, the statistics release, the ranks a ring round lost) and its weights.
The agent (node/agent.py) sends it; this module only says what is sent."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fedgpu.node import messages, policy
from fedgpu.node.rounds import workfiles
from fedgpu.node.rounds.process import RoundOutcome
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node")

KIND_NAMES = {pb.TASK_KIND_INIT: "init", pb.TASK_KIND_TRAIN: "train",
              pb.TASK_KIND_EVALUATE: "evaluate", pb.TASK_KIND_STATISTICS: "statistics"}


def build_update(task: pb.TaskHeader, node_id: str, decision: policy.Decision | None,
                 outcome: RoundOutcome | None, error: str
                 ) -> tuple[pb.UpdateHeader, Path | None, bool]:
    """(the update header, the weights to send or None, whether the task succeeded)."""
    ok = outcome is not None and outcome.ok
    update = messages.update_header(
        task, node_id, decision, outcome.resources if outcome else None,  # type: ignore[arg-type]
        outcome.result if ok else None, error or "unknown failure")  # type: ignore[union-attr]
    if ok and task.kind == pb.TASK_KIND_STATISTICS:
        # Held back and noised here, in the site's own code, never in task code.
        from fedgpu.node.statistics_release import answer
        ok = answer(task, update, outcome.result)  # type: ignore[union-attr]
    if not ok:
        if outcome is not None:
            # Ring mode: the ranks the worker lost, so the aggregator can name them.
            update.lost_ranks.extend(workfiles.lost_ranks(outcome.workdir))
        log.error("round %d failed: %s", task.round, update.error)
        return update, None, False
    assert outcome is not None
    log.info("round %d %s done in %.1fs: train %s eval %s", task.round,
             KIND_NAMES[task.kind], outcome.resources.get("round_seconds", 0),
             _fmt(update.train_metrics), _fmt(update.eval_metrics))
    return update, outcome.weights if task.kind != pb.TASK_KIND_EVALUATE else None, True


def _fmt(m: Any) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in sorted(dict(m).items())) or "-"
