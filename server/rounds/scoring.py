"""`mode = "evaluate"`: one round in which every chosen site scores the job's model (its
`initial_weights`, or the final model of an earlier job) on its held-out split. Nothing is
trained and no update is uploaded: a node answers an evaluate task with its metrics only.

The round is recorded like a training round (`fedgpu rounds`, the dashboard, `job status`
read it), with the per-site and example-weighted metrics as its `eval`. The model is not
changed; the engine commits it again as the model of round 1, so the job's progress reads
1 of 1 and `fedgpu job model` serves what was scored.
"""

from __future__ import annotations

import logging

from fedgpu.core.job import Job
from fedgpu.proto import pb
from fedgpu.server.registry import Node
from fedgpu.server.rounds.attempt import RoundState, RunFailed
from fedgpu.server.rounds.plans import TrainPlan
from fedgpu.server.rounds.records import EvalEntry, EvalSummary, RoundRecord
from fedgpu.server.strategies import make_strategy

log = logging.getLogger("fedgpu.server.rounds.engine")


class ScorePlan(TrainPlan):
    """The one round of an evaluate job. A TrainPlan only in shape: the engine holds a
    strategy for every job (its state is checkpointed), and this one is never fed."""

    kind = pb.TASK_KIND_EVALUATE
    aggregates = False
    recorded = True
    final_evaluation = False

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.strategy = make_strategy("fedavg", {}, None, 1)

    @property
    def evaluated_round(self) -> int:
        # The metrics are this round's own (its record's `eval`, filled at close), not the
        # evaluation of an earlier round's model, where answers.py would file them.
        assert self.run is not None, "bind the plan to its run first"
        return self.run.global_round + 1

    def pool_size(self) -> int:
        return self.job.min_available_nodes or self.job.min_nodes

    def choose(self, pool: list[Node], number: int, attempt: int) -> list[Node]:
        # Every connected site that can take the job: the point is to see all of them.
        return pool

    def required(self, chosen: list[Node]) -> int:
        return self.job.min_nodes

    def closed(self, rnd: RoundState, record: RoundRecord | None, chosen: list[Node],
               ok: bool) -> str:
        error = super().closed(rnd, record, chosen, ok)
        if not ok or record is None:
            return error
        record.eval = summary(record)
        if record.eval.num_examples <= 0:
            # Retrying cannot help: the task, not the sites, has nothing to score on.
            raise RunFailed(f"task {self.job.task!r} reported no held-out examples on any of "
                            f"the {len(record.updates)} site(s) that answered: it has no "
                            "evaluation (its evaluate() scores nothing), so mode = "
                            "\"evaluate\" cannot score a model with it")
        log.info("evaluation of the job's model: %s", ", ".join(
            f"{e.node} {fmt(e.metrics)} ({e.num_examples} examples)"
            for e in record.eval.per_node) + f"; weighted: {fmt(weighted(record.eval))}")
        return error


def summary(record: RoundRecord) -> EvalSummary:
    """The round's evaluation: each answering site's metrics, weighted by its examples."""
    out = EvalSummary()
    for u in record.updates:
        if u.num_eval_examples > 0 and u.eval_metrics:
            out.add(EvalEntry(u.node_id, u.node, u.num_eval_examples, dict(u.eval_metrics)))
    return out


def weighted(s: EvalSummary) -> dict[str, float]:
    return {k: v for k, v in (("loss", s.loss), ("accuracy", s.accuracy)) if v is not None}


def fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items(), reverse=True)
                    if k in ("loss", "accuracy"))
