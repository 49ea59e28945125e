"""What one kind of round is: which nodes, what each is told, what counts as success, what
happens after. The round loop (server/rounds/engine.py) is the same for all of them; a plan only
answers its questions, the way Flower's strategies split configure and aggregate.

Star training (`StarPlan`) and ring blocks (`fedgpu.server.rounds.ring.RingPlan`) are the two
training plans, each bringing its strategy; `InitPlan` fetches the starting model from one node and
`EvalPlan` runs the final federated evaluation, in either mode.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

from fedgpu.core.hetero_config import LocalWork
from fedgpu.core.job import Job
from fedgpu.core.job_bounds import derived_seed
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.intakes import Intake
from fedgpu.server.rounds.records import RoundRecord, UpdateRecord
from fedgpu.server.rounds.sampling import sample
from fedgpu.server.strategies import make_strategy
from fedgpu.server.strategies.base import Strategy
from fedgpu.server.strategies.private import PrivateStrategy

log = logging.getLogger("fedgpu.server.rounds.engine")

KIND_NAMES = {
    pb.TASK_KIND_INIT: "init",
    pb.TASK_KIND_TRAIN: "train",
    pb.TASK_KIND_EVALUATE: "evaluate",
    pb.TASK_KIND_STATISTICS: "statistics",
    pb.TASK_KIND_LOCAL_MODEL: "local model",
}


class RunView(Protocol):
    """What a plan may read of the run it serves."""

    @property
    def run_id(self) -> str: ...

    @property
    def global_round(self) -> int: ...


class Plan(ABC):
    kind: ClassVar[int]
    # The global model goes out with the task (not for INIT: the node builds the model).
    sends_model: ClassVar[bool] = True
    # Accepted updates are fed to the strategy, and a success makes a new global model.
    aggregates: ClassVar[bool] = False
    # Closed attempts are round records in the history.
    recorded: ClassVar[bool] = False
    # The job's plan: after its last round, the final federated evaluation (`evaluate`)
    # scores the last model (an evaluate job's own round already did: server/rounds/scoring.py).
    final_evaluation: ClassVar[bool] = True
    # A success is a round of the run though no model comes of it (mode = "statistics").
    advances: ClassVar[bool] = False

    def __init__(self, job: Job) -> None:
        self.job = job
        self.run: RunView | None = None

    def bind(self, run: RunView) -> None:
        self.run = run

    @property
    def evaluated_round(self) -> int:
        assert self.run is not None, "bind the plan to its run first"
        return self.run.global_round

    def attempts(self) -> int:
        return self.job.round_retries + 1

    @abstractmethod
    def pool_size(self) -> int:
        """How many eligible nodes must be connected before an attempt opens."""

    @abstractmethod
    def choose(self, pool: list[Node], number: int, attempt: int) -> list[Node]:
        """The participants of this attempt, from the eligible connected nodes."""

    def required(self, chosen: list[Node]) -> int:
        return len(chosen)

    def task_fields(self, number: int, attempt: int, chosen: list[Node]
                    ) -> list[dict[str, Any]]:
        """Per participant (in `chosen` order), the TaskHeader fields of this mode."""
        seed = derived_seed(self.job.seed, number, attempt)  # within the wire's int64
        return [{"seed": seed} for _ in chosen]

    def describe(self, rnd: RoundState, chosen: list[Node]) -> str:
        return (f"round {rnd.number} ({KIND_NAMES[self.kind]}, attempt {rnd.attempt}) opened "
                f"for {len(chosen)} node(s): {', '.join(n.name for n in chosen)}")

    def stop_waiting(self, rnd: RoundState, registry: Registry, now: float) -> bool:
        """Close before the deadline? By default when every node still awaited is gone
        (replaced by a re-registration): a vanished participant can't answer."""
        waiting = rnd.waiting_on()
        return bool(waiting) and all(registry.get(nid) is None for nid in waiting)

    def succeeded(self, rnd: RoundState) -> bool:
        return rnd.accepted() >= rnd.required

    def series_length(self) -> int:
        """How many per-iteration losses an update of this round may carry."""
        return 0

    def on_update(self, update: UpdateRecord, header: pb.UpdateHeader) -> None:  # noqa: B027
        """Add what this mode keeps of an accepted update's header (nothing by default)."""

    # Asynchronous modes (server/rounds/buffered.py) answer tasks of earlier attempts too.
    def opened(self, rnd: RoundState) -> None:  # noqa: B027
        """The attempt's tasks are out (async: tasks still in flight join it)."""

    def answers(self, rnd: RoundState, header_round: int) -> bool:
        """Does an update for a task of round `header_round` belong to this attempt?"""
        return rnd.number == header_round

    def stale_reason(self, rnd: RoundState, header_round: int) -> str | None:
        """Why an update for a task of `header_round` comes too late to be used, if it does."""
        return None

    def carries(self, rnd: RoundState, node_id: str) -> bool:
        """At close: does this node's unanswered task stay in flight (not dropped)?"""
        return False

    def closed(self, rnd: RoundState, record: RoundRecord | None, chosen: list[Node],
               ok: bool) -> str:
        """After an attempt closed (and was recorded): annotate the record, log, and say what
        went wrong when it did not succeed."""
        error = rnd.error or (f"round {rnd.number} attempt {rnd.attempt} closed with "
                              f"{rnd.accepted()} of {rnd.required} required updates")
        if record is not None and self.job.hetero.local_work is LocalWork.TIME:
            # Equal time, unequal work: the budget marks the round, so that readers (the
            # dashboard) show each site's steps and examples (its updates' train metrics).
            record.extra["round_train_s"] = self.job.hetero.round_train_s
        if not ok:
            log.warning("%s; retrying", error)
        elif record is not None:
            # One line per round for `fedgpu job logs --follow`: what a person watches for.
            log.info("%s", round_line(record))
        return error

    def give_up(self, number: int, error: str) -> str:
        """The RunFailed message once every attempt failed."""
        return (f"round {number} did not get {self.job.min_nodes} usable updates in "
                f"{self.attempts()} attempts (last: {error})")

    def checkpoint_extra(self) -> dict[str, Any]:
        return {}

    def intake(self, kind: int) -> Intake | None:
        """Who takes answers of `kind` that this plan owns beyond plain updates (secure
        aggregation's messages); None: server/rounds/receive.py takes them as updates."""
        return None


class TrainPlan(Plan):
    """A training round: brings the strategy that turns its updates into the next model."""

    kind = pb.TASK_KIND_TRAIN
    aggregates = True
    recorded = True
    strategy: Strategy


class StarPlan(TrainPlan):
    """FedAvg and friends: a seeded sample of the pool trains; the strategy combines."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.strategy = make_strategy(job.strategy, job.strategy_params, job.privacy,
                                      job.rounds)

    def pool_size(self) -> int:
        return self.job.min_available_nodes or self.job.min_nodes

    def task_fields(self, number: int, attempt: int, chosen: list[Node]
                    ) -> list[dict[str, Any]]:
        fields = super().task_fields(number, attempt, chosen)
        dp = self.strategy
        if isinstance(dp, PrivateStrategy) and dp.distributed:
            # Distributed DP: each node clips its update and adds its share of the noise
            # before secure aggregation masks it (server/secagg/plan.py checks the range).
            share = pb.PrivacyDistributedDp(clip_norm=dp.clip_norm,
                                            noise_multiplier=dp.noise_multiplier)
            fields = [{**f, "privacy_distributed": share} for f in fields]
        elif isinstance(dp, PrivateStrategy) and not dp.central:
            # Local DP: each node clips and noises its own update before it uploads it.
            local = pb.PrivacyLocalDp(clip_norm=dp.clip_norm, noise_multiplier=dp.noise_multiplier)
            fields = [{**f, "privacy_local": local} for f in fields]
        return fields

    def choose(self, pool: list[Node], number: int, attempt: int) -> list[Node]:
        by_name = {n.name: n for n in pool}
        return [by_name[name] for name in sample(by_name, self.job.fraction, self.job.min_nodes,
                                                 self.job.seed, number, attempt)]

    def required(self, chosen: list[Node]) -> int:
        return self.job.min_nodes


class InitPlan(Plan):
    """Ask one node for the task's initial weights: the aggregator never runs torch."""

    kind = pb.TASK_KIND_INIT
    sends_model = False

    def pool_size(self) -> int:
        return max(1, self.job.min_nodes)

    def choose(self, pool: list[Node], number: int, attempt: int) -> list[Node]:
        # Another node on each retry: the one that failed may fail again.
        return [pool[(attempt - 1) % len(pool)]]

    def closed(self, rnd: RoundState, record: RoundRecord | None, chosen: list[Node],
               ok: bool) -> str:
        if ok:
            log.info("initial model from %s", chosen[0].name)
        else:
            log.warning("initialisation attempt %d got no model; retrying", rnd.attempt)
        # The node's own words (e.g. Opacus refusing the model under dp_sgd) reach the job.
        return rnd.failures[-1].error if rnd.failures else "no initial model"

    def give_up(self, number: int, error: str) -> str:
        why = f" (last: {error})" if error != "no initial model" else ""
        return f"no node returned initial weights{why}; check the nodes' logs"


class EvalPlan(Plan):
    """The final federated evaluation: every connected node scores the last global model."""

    kind = pb.TASK_KIND_EVALUATE

    def attempts(self) -> int:
        return 1

    def pool_size(self) -> int:
        return 1

    def choose(self, pool: list[Node], number: int, attempt: int) -> list[Node]:
        return pool

    def required(self, chosen: list[Node]) -> int:
        return 1

    def succeeded(self, rnd: RoundState) -> bool:
        # Whatever arrived by the deadline is the evaluation; nothing to retry.
        return True

    def closed(self, rnd: RoundState, record: RoundRecord | None, chosen: list[Node],
               ok: bool) -> str:
        return ""


def round_line(record: RoundRecord) -> str:
    """`round 3 closed: 4 updates, train loss 0.4121, 0.9 s; model of round 2: loss 0.3877,
    accuracy 0.9100` — the evaluation is the nodes' of the model they received."""
    parts = [f"round {record.round} closed: {record.nodes_reporting} updates"]
    if record.train_loss is not None:
        parts.append(f"train loss {record.train_loss:.4f}")
    parts.append(f"{record.duration_s:.1f} s")
    line = ", ".join(parts)
    weighted: dict[str, float] = {}
    total = 0
    for u in record.updates:
        if u.num_eval_examples <= 0:
            continue
        total += u.num_eval_examples
        for key in ("loss", "accuracy"):
            if key in u.eval_metrics:
                weighted[key] = weighted.get(key, 0.0) + u.eval_metrics[key] * u.num_eval_examples
    if total and weighted:
        shown = ", ".join(f"{k} {v / total:.4f}" for k, v in sorted(weighted.items(),
                                                                    reverse=True))
        line += f"; model of round {record.round - 1}: {shown}"
    return line
