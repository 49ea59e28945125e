"""Update acceptance: what the Federation service asks of the round engine when a node
answers a task. Checks an update's header against the open round, records failures and
refusals, and folds accepted updates into the strategy.

`Answers` is a collaborator the engine (server/rounds/engine.py) holds as `orch.answers`: it
reads the run through the narrow `Run` view below and changes the open attempt, its nodes'
records and the history (the strategy through the fold queue); the engine keeps the loop,
the global model (a starting model comes back through `take_initial`) and the checkpoints.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from fedgpu.core import local_params
from fedgpu.core.job import Job
from fedgpu.core.site_policy import REFUSAL_MEMORY_S, REFUSAL_PREFIX
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.folding import FoldQueue, Waiting
from fedgpu.server.rounds.history import History
from fedgpu.server.rounds.plans import Plan
from fedgpu.server.rounds.records import (
    EvalEntry,
    Failure,
    Ineligibility,
    Rejection,
    Resources,
    UpdateRecord,
    list_rejection,
)
from fedgpu.server.rounds.states import SlotState
from fedgpu.server.rounds.takeover import Holders
from fedgpu.server.strategies.base import Strategy
from fedgpu.server.transfer.payload import wire_spec
from fedgpu.server.transfer.wire_limits import shown

log = logging.getLogger("fedgpu.server.rounds.engine")


class Run(Protocol):
    """What the answers read of the run they serve (the engine, server/rounds/engine.py)."""

    @property
    def job(self) -> Job: ...
    @property
    def job_id(self) -> str: ...
    @property
    def current(self) -> RoundState | None: ...
    @property
    def current_plan(self) -> Plan: ...
    @property
    def history(self) -> History: ...
    @property
    def strategy(self) -> Strategy: ...
    @property
    def global_spec(self) -> dict[str, tuple[str, tuple[int, ...]]] | None: ...
    @property
    def registry(self) -> Registry: ...

    def take_initial(self, tensors: dict[str, np.ndarray]) -> None:
        """The starting model a node sent (an INIT task's answer) becomes the global one."""


class Answers:
    def __init__(self, run: Run, lock: asyncio.Lock) -> None:
        self.run = run
        # Training updates into the strategy, several at once when they arrive together; the
        # lock is the engine's, held while it begins or finishes the strategy's round.
        self._folds = FoldQueue(lock)
        # Streams holding slots, accepted digests (server/rounds/takeover.py).
        self.holders = Holders()

    @property
    def wire_spec(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """What a training update must match: the global model's names, shapes and dtypes,
        float32 as the job's wire_dtype when it has one, less the job's local tensors
        (local_params: an update that holds one is refused)."""
        spec = self.run.global_spec
        if spec is not None and self.run.job.local_params:
            spec = local_params.shared(spec, self.run.job.local_params)
        return wire_spec(spec, self.run.job.wire_dtype)

    def check_update(self, node: Node, header: pb.UpdateHeader) -> RoundState:
        """The open round this header answers; UpdateRejected when it answers none."""
        rnd = self.run.current
        stale = rnd is not None and self.run.current_plan.stale_reason(rnd, header.round)
        if stale:
            raise UpdateRejected(Reject.STALE_ROUND, stale)
        if rnd is None or not self.run.current_plan.answers(rnd, header.round):
            if self.run.history.last_of(header.round) is not None:
                raise UpdateRejected(
                    Reject.LATE, f"round {header.round} already closed: the update arrived "
                    "after its deadline and was dropped")
            raise UpdateRejected(
                Reject.STALE_ROUND, f"round {header.round} is not the current round "
                f"({rnd.number if rnd else 'none open'})")
        state = rnd.slots.get(node.node_id)
        if state is None:
            raise UpdateRejected(Reject.NOT_SELECTED, f"node {node.name} was not selected for "
                                 f"round {rnd.number}")
        if rnd.task_ids.get(node.node_id) != header.task_id:
            raise UpdateRejected(Reject.WRONG_TASK, f"task id {shown(header.task_id)} was not "
                                 f"given to {node.name} in round {rnd.number}")
        if state != SlotState.ASSIGNED:
            raise UpdateRejected(Reject.DUPLICATE, f"{node.name} already sent its update for "
                                 f"round {rnd.number} ({state})")
        if len(header.iteration_loss) > self.run.current_plan.series_length():
            raise UpdateRejected(Reject.MALFORMED, f"iteration_loss has "
                                 f"{len(header.iteration_loss)} values; this round runs "
                                 f"{self.run.current_plan.series_length()} iterations")
        if header.kind != rnd.kind:
            raise UpdateRejected(Reject.WRONG_KIND, "update kind does not match the task")
        if header.kind == pb.TASK_KIND_TRAIN and not (header.failed or header.ineligible):
            self._check_examples(node, header.num_examples)
        return rnd

    def _check_examples(self, node: Node, claimed: int) -> None:
        # FedAvg weighs an update by this claim: unbounded, one node could outweigh all.
        if claimed <= 0:
            raise UpdateRejected(Reject.NUM_EXAMPLES, "num_examples must be positive")
        cap = self.run.job.max_examples_per_node
        if cap is not None and claimed > cap:
            raise UpdateRejected(Reject.NUM_EXAMPLES, f"{node.name} claims {claimed} examples; "
                                 f"this job counts at most {cap} per node "
                                 "(max_examples_per_node)")
        if node.stated_examples and claimed > node.stated_examples:
            raise UpdateRejected(Reject.NUM_EXAMPLES, f"{node.name} claims {claimed} examples "
                                 f"but stated {node.stated_examples} (its training-set size)")

    def claim(self, node: Node, rnd: RoundState) -> None:
        """Take the node's slot for the stream now receiving its answer.

        Called right after check_update, with no await between: on the event loop that makes
        "is the slot free?" and "it is mine" one step, so of many concurrent streams of one
        update exactly one goes on and the others are refused as duplicates at their header.
        """
        assert rnd.slots.get(node.node_id) == SlotState.ASSIGNED
        rnd.slots[node.node_id] = SlotState.UPLOADING

    def release(self, node: Node, rnd: RoundState) -> None:
        """The claiming stream broke off (the sender went away): the node may send again."""
        if not rnd.closed and rnd.slots.get(node.node_id) == SlotState.UPLOADING:
            rnd.slots[node.node_id] = SlotState.ASSIGNED

    def reject(self, node: Node | None, header: pb.UpdateHeader | None, exc: UpdateRejected,
               rnd: RoundState | None = None, claimed: bool = False,
               ends_part: bool = True) -> None:
        """Count and list a refusal. A refused answer to the node's own open task ends its
        part in the attempt, unless another stream of that node holds the slot (`claimed`
        says whether the refused stream is the one holding it) or `ends_part` is False (a
        stream cut short: its node may resume it)."""
        self.run.history.count_rejection(exc.reason)
        entry = Rejection(
            node_id=node.node_id if node else None,
            node=node.name if node else None,
            round=header.round if header else None,
            reason=exc.reason,
            message=exc.message,
        )
        rnd = rnd or self.run.current
        if (rnd is not None and not rnd.closed and node is not None and header is not None
                and rnd.task_ids.get(node.node_id) == header.task_id
                and rnd.number == header.round):
            list_rejection(rnd, entry)
            state = rnd.slots.get(node.node_id)
            if not ends_part:
                if claimed:
                    self.release(node, rnd)
            elif state == SlotState.ASSIGNED or (claimed and state == SlotState.UPLOADING):
                node.assigned.pop(self.run.job_id, None)
                rnd.settle(node.node_id, SlotState.REJECTED, time.time())
        elif header is not None:
            # Not an answer to an open task (late, stale, forged): still listed under the round
            # it names, so `fedgpu rounds --json` shows every refusal, not just a counter.
            if rnd is not None and not rnd.closed and rnd.number == header.round:
                list_rejection(rnd, entry)
            else:
                self.run.history.file_rejection(entry)
        log.warning("rejected update from %s: %s", entry.node or "an unknown node", exc.message)

    def record_failure(self, node: Node, header: pb.UpdateHeader, rnd: RoundState) -> None:
        rnd.failures.append(Failure(node.node_id, node.name, header.error))
        if header.lost_ranks:
            rnd.lost_ranks[node.node_id] = list(header.lost_ranks)
        node.rounds_failed += 1
        node.last_error = header.error
        node.assigned.pop(self.run.job_id, None)
        log.warning("round %d: %s failed: %s", rnd.number, node.name, header.error,
                    extra={"node": node.name, "job_id": self.run.job_id})
        rnd.settle(node.node_id, SlotState.FAILED, time.time())

    def record_ineligible(self, node: Node, header: pb.UpdateHeader, rnd: RoundState) -> None:
        """The node cannot take the job now: not its failure, and its answer is remembered
        (server/rounds/eligibility.py) so the next attempt samples among the others."""
        reason = header.ineligible_reason or "no reason given"
        rnd.ineligible.append(Ineligibility(node.node_id, node.name, reason))
        if reason.startswith(REFUSAL_PREFIX):
            # The site's policy: about this job, not its GPUs (other jobs may still fit).
            node.policy_refusal = (self.run.job, time.time() + REFUSAL_MEMORY_S, reason)
        else:
            node.refusal = (self.run.job.needs, reason)
        node.assigned.pop(self.run.job_id, None)
        log.info("round %d: %s cannot take this job now: %s", rnd.number, node.name, reason,
                 extra={"node": node.name, "job_id": self.run.job_id})
        rnd.settle(node.node_id, SlotState.INELIGIBLE, time.time())

    def wants(self, node: Node, task_id: str) -> bool:
        """Is `task_id` `node`'s task in the open round? Else a heartbeat tells the node to
        abandon it: its job was stopped, or its round closed (an answer would be refused)."""
        rnd = self.run.current
        return rnd is not None and not rnd.closed and rnd.task_ids.get(node.node_id) == task_id

    async def accept(
        self, node: Node, header: pb.UpdateHeader, rnd: RoundState,
        tensors: dict[str, np.ndarray] | None, payload_bytes: int,
        told: Callable[[], None] | None = None,
    ) -> None:
        """Take a received update into its round (a training update into the sum); `told`
        is called as soon as nothing can refuse it any more, which may be before its fold
        ends (server/rounds/folding.py); UpdateRejected if something does."""
        # The caller holds the slot (claim): anything else means the round closed meanwhile.
        if rnd.closed or rnd.slots.get(node.node_id) != SlotState.UPLOADING:
            raise UpdateRejected(Reject.LATE,
                                 f"round {rnd.number} closed while the update streamed")
        if header.kind == pb.TASK_KIND_INIT:
            assert tensors is not None
            self.run.take_initial(tensors)
        elif header.kind == pb.TASK_KIND_LOCAL_MODEL:  # cross-site: a site's local model
            assert tensors is not None
            self.run.current_plan.take_model(node.name, dict(tensors))  # type: ignore[attr-defined]
        elif header.kind == pb.TASK_KIND_TRAIN:
            assert tensors is not None
            settled = None if told is None else functools.partial(self._settled, node, told)
            await self._folds.fold(self.run.strategy, Waiting(
                rnd, tensors, header.num_examples, dict(header.train_metrics),
                rnd.number - header.round, settled))
        rnd.bytes_received += payload_bytes
        resources = Resources.from_wire(header.resources)
        update = UpdateRecord(
            node_id=node.node_id,
            node=node.name,
            num_examples=header.num_examples,
            train_metrics=dict(header.train_metrics),
            eval_metrics=dict(header.eval_metrics),
            num_eval_examples=header.num_eval_examples,
            resources=resources,
            upload_s=rnd.upload_s.get(node.node_id),
            gpu_decision=node.decision,
            transport=rnd.transport.get(node.node_id),
        )
        self.run.current_plan.on_update(update, header)
        rnd.updates.append(update)
        node.assigned.pop(self.run.job_id, None)
        node.last_round = rnd.number
        node.last_resources = resources.to_dict()
        if header.kind == pb.TASK_KIND_TRAIN:
            node.rounds_completed += 1
            # Its training time joins its link's round-trip estimate (link_admission.py).
            self.run.registry.link(node.name).train_s = resources.train_seconds
            node.measured(self.run.job.task, _speed(header, resources.train_seconds,
                                                self.run.job.hyperparameters.get("local_epochs")))
            # A node that stated no size at registration states it with its first update.
            node.stated_examples = node.stated_examples or header.num_examples
        if header.eval_metrics:
            self.run.history.attach_eval(header.evaluated_round, EvalEntry(
                node.node_id, node.name, header.num_eval_examples, dict(header.eval_metrics)))
        rnd.settle(node.node_id, SlotState.ACCEPTED, time.time())
        self.holders.accepted(header)

    def _settled(self, node: Node, told: Callable[[], None]) -> None:
        # Its node, told, polls on at once: it must not be handed this task again while the
        # sum is written (it would train it twice).
        node.assigned.pop(self.run.job_id, None)
        told()

    async def take_over(self, node: Node, header: pb.UpdateHeader) -> None:
        """A node's new answer to its task ends its own older stream still holding the slot."""
        rnd = self.run.current

        def uploading() -> bool:
            return (rnd is not None and not rnd.closed
                    and rnd.task_ids.get(node.node_id) == header.task_id
                    and rnd.slots.get(node.node_id) == SlotState.UPLOADING)

        await self.holders.take_over(node.node_id, header.task_id, uploading)


def _speed(header: pb.UpdateHeader, train_seconds: float, epochs: object) -> float:
    """Examples trained per second this round, for the estimate at submit: the node's own
    figure when its loop reports one, else the examples it says it saw (or its set times the
    job's epochs) over its training time; 0 when unknown."""
    metrics = header.train_metrics
    if "examples_per_s" in metrics:
        return metrics["examples_per_s"]
    if train_seconds <= 0:
        return 0.0
    if "examples" in metrics:
        return metrics["examples"] / train_seconds
    passes = epochs if isinstance(epochs, int) and not isinstance(epochs, bool) else 1
    return header.num_examples * passes / train_seconds
