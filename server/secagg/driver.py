"""One secure-aggregation attempt on the aggregator: the stages, their waits, the relays.

The engine opens the attempt (TRAIN tasks carrying the Setup) and waits on `rnd.done`; this
driver, a task on the event loop, then takes the protocol stage by stage. A stage closes when
every participant still in it has answered, or at its deadline (the round's deadline for the
first, which follows training; `stage_timeout_s` for the others); whoever has not answered by
then dropped at that stage. The relays go out as tasks of the next stage's kind for the same
task id, their payload the relay's bytes. At the end the unmasked mean (a change to the model)
is added to the global model and fed to the strategy as one update with the total weight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.core import codec, digests, segment_hasher
from fedgpu.core.secagg import layout
from fedgpu.core.secagg.aggregator import AggregatorSession, Outcome
from fedgpu.core.secagg.errors import SecAggError, Stage, TooFewInputs
from fedgpu.core.secagg.jobfile import JobSecAgg
from fedgpu.core.secagg.messages import (
    MaskedInput,
    PublicKeys,
    ShareKeys,
    UnmaskReply,
    ViewSignature,
)
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rejections import Reject
from fedgpu.server.rounds.attempt import RoundState, Task
from fedgpu.server.rounds.states import SlotState
from fedgpu.server.transfer.payload import ModelPayload

log = logging.getLogger("fedgpu.server.secagg")

# The kind of task a stage's relay goes out as, and of the update answering it.
KIND_OF: dict[Stage, int] = {
    Stage.ADVERTISE_KEYS: pb.TASK_KIND_SECAGG_ADVERTISE_KEYS,
    Stage.SHARE_KEYS: pb.TASK_KIND_SECAGG_SHARE_KEYS,
    Stage.MASKED_INPUT: pb.TASK_KIND_SECAGG_MASKED_INPUT,
    Stage.CONSISTENCY: pb.TASK_KIND_SECAGG_CONSISTENCY,
    Stage.UNMASK: pb.TASK_KIND_SECAGG_UNMASK,
}
STAGE_OF: dict[int, Stage] = {v: k for k, v in KIND_OF.items()}
_OPEN = (SlotState.ASSIGNED, SlotState.UPLOADING)


def _payload(data: bytes | bytearray) -> ModelPayload:
    views = (memoryview(data),)
    digest, segs = segment_hasher.of_views(views)  # codec.WIRE_DIGEST, in one pass
    return ModelPayload(len(data), digest, codec.WIRE_DIGEST, None, views,
                        _segment_digests=segs)


class SecAggRound:
    def __init__(self, config: JobSecAgg, chosen: list[Node],
                 global_weights: Mapping[str, np.ndarray],
                 max_examples: int | None = None, min_inputs: int = 0,
                 noised: bool = False) -> None:
        self.config = config
        # The round's required inputs (min_nodes): a stage that leaves fewer sites ends the
        # attempt before any unmask request goes out, in every mode. One sum per round is
        # ever unmasked: a retry after a smaller sum would give the difference, one site's
        # update (and its example count).
        self.min_inputs = min_inputs
        # Distributed DP: every masked input must say it carries a noise share.
        self.noised = noised
        self.node_ids = {i + 1: n.node_id for i, n in enumerate(chosen)}
        self.index = {nid: i for i, nid in self.node_ids.items()}
        self.names = {i + 1: n.name for i, n in enumerate(chosen)}
        # What the sites stated at registration bounds their weights (an update may not claim
        # more), and with it the sum: the ring can be 32 bits when that is small enough.
        stated = [n.stated_examples for n in chosen]
        if max_examples is not None:
            stated = [min(s, max_examples) if s > 0 else max_examples for s in stated]
        # The sites' training and evaluation numbers travel masked after the weight and come
        # out as sums (fedgpu/core/secagg/masked_metrics.py); under distributed DP the sites
        # send the evaluation only (the noise covers the update, not its statistics).
        self.params = config.settings.resolve(len(chosen), layout.length(global_weights),
                                              stated, metrics=True)
        # The roster (site names by index) lets sites with a TLS identity check that each
        # neighbour's certificate is the registered site's (fedgpu/core/secagg/identity.py).
        self.session = AggregatorSession(
            self.params, roster=tuple(self.names[i] for i in sorted(self.names)))
        self.setups = {self.node_ids[i]: s.encode() for i, s in self.session.start().items()}
        self.stage = Stage.ADVERTISE_KEYS
        self._expected: set[int] = set(self.node_ids)
        self._answered: set[int] = set()
        self._progress = asyncio.Event()
        self._lock = asyncio.Lock()
        # The MASKED_INPUT header of each site (its metrics, resources): the round's records.
        self.headers: dict[int, pb.UpdateHeader] = {}
        self.outcome: Outcome | None = None
        self.failure: SecAggError | None = None
        # From the first site's public keys (training over for it) to the end.
        self.first_keys_at: float | None = None
        self.protocol_s = 0.0
        self.unmask_s = 0.0
        self.task: asyncio.Task[None] | None = None
        # The job whose round this is: its stage tasks are filed under it (node.assigned).
        self.job_id = ""

    # -- what the intake asks ------------------------------------------------------------

    def expects(self, node_id: str, kind: int) -> tuple[Reject, str] | None:
        """None when `node_id`'s message of `kind` is due now; else the reason it is not."""
        i = self.index.get(node_id)
        stage = STAGE_OF.get(kind)
        if i is None or stage is None:
            return Reject.NOT_SELECTED, "not a participant of this secure round"
        if self.failure is not None or self.outcome is not None:
            return Reject.LATE, "the secure round is over"
        if stage != self.stage:
            return Reject.LATE, f"a {stage} message while the round is at {self.stage}"
        if i in self._answered:
            return Reject.DUPLICATE, f"its {stage} message arrived already"
        if i not in self._expected:
            return Reject.LATE, f"it dropped out before {stage}"
        return None

    async def receive(self, node: Node, header: pb.UpdateHeader, data: memoryview) -> None:
        """Hand one site's message to the session; SecAggError when it cannot be used."""
        i = self.index[node.node_id]
        stage = STAGE_OF[header.kind]
        agg = self.session
        if stage == Stage.ADVERTISE_KEYS:
            msg: Any = PublicKeys.decode(data)
        elif stage == Stage.SHARE_KEYS:
            msg = ShareKeys.decode(data)
        elif stage == Stage.MASKED_INPUT:
            msg = MaskedInput.decode(data)
        elif stage == Stage.CONSISTENCY:
            msg = ViewSignature.decode(data)
        else:
            msg = UnmaskReply.decode(data)
        if msg.index != i:
            raise SecAggError(f"{node.name} sent a message as site {msg.index}; it is site {i}")
        if stage == Stage.MASKED_INPUT and self.noised and (
                "ddp_noise_std" not in header.train_metrics):
            # A node that ignored the task's privacy_distributed (an older one) masked its
            # update without noise: it must not be in the sum.
            raise SecAggError(f"{node.name} sent its masked input without a distributed-DP "
                              "noise share (does it run an older fedgpu?)")
        if stage == Stage.MASKED_INPUT:
            # A model-sized add: off the event loop, one at a time.
            async with self._lock:
                if self.expects(node.node_id, header.kind) is not None:
                    raise SecAggError("the masked-input stage closed while it arrived")
                await asyncio.to_thread(agg.receive_masked, msg)
            self.headers[i] = header
        elif stage == Stage.ADVERTISE_KEYS:
            agg.receive_keys(msg)
            if self.first_keys_at is None:
                self.first_keys_at = time.monotonic()
        elif stage == Stage.SHARE_KEYS:
            agg.receive_shares(msg)
        elif stage == Stage.CONSISTENCY:
            agg.receive_view(msg)
        else:
            agg.receive_unmask(msg)
        self._answered.add(i)
        # The node's last task is answered: it waits for the next stage's relay.
        node.assigned.pop(self.job_id, None)
        self._progress.set()

    # -- the driver ----------------------------------------------------------------------

    def start(self, rnd: RoundState, registry: Registry, on_result: Any) -> None:
        self.task = asyncio.get_running_loop().create_task(
            self._drive(rnd, registry, on_result), name=f"secagg round {rnd.number}")

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    async def _collect(self, rnd: RoundState, registry: Registry, deadline: float) -> None:
        """Until every site still in the stage answered, or the deadline."""
        while True:
            gone = {i for i, nid in self.node_ids.items()
                    if rnd.slots.get(nid) not in _OPEN or registry.get(nid) is None}
            if not (self._expected - self._answered - gone):
                return
            left = deadline - time.time()
            if left <= 0:
                return
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), timeout=min(left, 1.0))
            except TimeoutError:
                pass

    def _dispatch(self, rnd: RoundState, registry: Registry, stage: Stage,
                  messages: Mapping[int, Any]) -> None:
        for i, msg in messages.items():
            node = registry.get(self.node_ids[i])
            if node is None or rnd.slots.get(node.node_id) not in _OPEN:
                continue
            payload = _payload(msg.encode())
            header = pb.TaskHeader(task_id=rnd.task_ids[node.node_id], round=rnd.number,
                                   kind=KIND_OF[stage], payload_size=payload.size,
                                   secagg_stage_timeout_s=self.config.stage_timeout_s)
            digests.stamp(header, payload.algorithm, payload.digest)
            node.assigned[self.job_id] = Task(header.task_id, rnd.number, header.kind, header,
                                              payload)
            node.wakeup.set()

    async def _drive(self, rnd: RoundState, registry: Registry, on_result: Any) -> None:
        agg = self.session
        timeout = self.config.stage_timeout_s
        closers: dict[Stage, Any] = {
            Stage.ADVERTISE_KEYS: agg.close_keys, Stage.SHARE_KEYS: agg.close_shares,
            Stage.MASKED_INPUT: agg.close_masked, Stage.CONSISTENCY: agg.close_consistency}
        # The first stage follows training and ends at the round's deadline; the engine's
        # own wait (and the uploads') must last until the protocol's last stage is over.
        deadline = rnd.deadline
        rnd.deadline = deadline + 4 * timeout + 5
        try:
            stage = Stage.ADVERTISE_KEYS
            while stage != Stage.UNMASK:
                await self._collect(rnd, registry, deadline)
                async with self._lock:
                    relays = closers[stage]()
                    # The session says what comes next: signed rounds (sites with a TLS
                    # identity) have the consistency check before unmasking.
                    following = agg.stage
                    self.stage = following
                if len(relays) < self.min_inputs:
                    raise TooFewInputs(stage, len(relays), self.min_inputs)
                log.info("round %d: secure aggregation %s closed, %d of %d sites go on",
                         rnd.number, stage, len(relays), len(self._expected))
                self._expected, self._answered = set(relays), set()
                deadline = time.time() + timeout
                rnd.deadline = max(rnd.deadline, deadline + 2 * timeout + 5)
                self._dispatch(rnd, registry, following, relays)
                stage = following
            await self._collect(rnd, registry, deadline)
            t0 = time.monotonic()
            outcome = await asyncio.to_thread(agg.finish)
            self.unmask_s = time.monotonic() - t0
            log.info("round %d: secure aggregation unmasked %d inputs in %.2fs",
                     rnd.number, outcome.report.masked, self.unmask_s)
            await on_result(outcome)
            self.outcome = outcome
        except SecAggError as exc:
            self.failure = exc
            log.warning("round %d attempt %d: %s", rnd.number, rnd.attempt, exc)
        finally:
            if self.first_keys_at is not None:
                self.protocol_s = time.monotonic() - self.first_keys_at
            rnd.done.set()

    # -- what the round record shows ---------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """`fedgpu rounds --json` `secure_aggregation` of this attempt."""
        out: dict[str, Any] = {
            "sites": len(self.node_ids),
            "threshold": self.params.threshold,
            "neighbours": self.params.degree,
            "protocol_s": round(self.protocol_s, 3),
            # The ring ("auto" picks 32 when the sum fits) and the weight bound sites capped at.
            "ring_bits": self.params.ring_bits,
            "max_weight": self.params.max_weight,
            # Sites with a TLS identity signed their keys and their survivor sets.
            "signed": self.session.signed,
        }
        if self.outcome is not None:
            rep = self.outcome.report
            out.update(
                masked=rep.masked,
                dropped={str(s): [self.names[i] for i in d] for s, d in rep.dropped.items()},
                recovered=rep.recovered, total_weight=self.outcome.total_weight,
                unmask_s=round(self.unmask_s, 3))
        if self.failure is not None:
            out["failed"] = {"stage": str(getattr(self.failure, "stage", self.stage)),
                             "reason": str(self.failure)}
        return out
