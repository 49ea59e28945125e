"""A node's secure-aggregation message arriving as an update (kinds TASK_KIND_SECAGG_*), by
either path: checked against the open attempt, its payload handed to the round's driver. The
job's `SecAggPlan` owns this intake and hands it these kinds (`Plan.intake`,
server/rounds/intakes.py): the round engine's own intake never sees them.

A message the driver cannot use (undecodable, another site's index, a protocol violation) is
refused like a bad update: listed, counted, and the node's part in the attempt is over. One
that is only repeated or late is refused and listed, and the site stays as the protocol has it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol, cast

from fedgpu.core.constants import Transport
from fedgpu.core.secagg.errors import SecAggError
from fedgpu.proto import pb
from fedgpu.server.registry import Node
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.intakes import Receive
from fedgpu.server.rounds.plans import RunView
from fedgpu.server.rounds.records import Rejection, list_rejection
from fedgpu.server.rounds.states import SlotState
from fedgpu.server.secagg.driver import STAGE_OF, SecAggRound
from fedgpu.server.transfer import wire_limits
from fedgpu.server.transfer.wire_limits import WireError, shown

if TYPE_CHECKING:
    from fedgpu.server.rounds.engine import Orchestrator

log = logging.getLogger("fedgpu.server.secagg")

SECAGG_KINDS = frozenset(STAGE_OF)


class Untimely(UpdateRejected):
    """A message repeated, or too late for its stage: refused, but it does not end the
    site's part (the protocol already counts it as dropped at that stage, or has its
    message)."""


class Owner(Protocol):
    """What the intake reads of the plan that owns it (server/secagg/plan.py)."""

    round: SecAggRound | None
    run: RunView | None


class SecAggIntake:
    """Takes the secure-aggregation messages of its plan's open attempts (an `Intake`)."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner

    @property
    def _orch(self) -> Orchestrator:
        # The run a plan is bound to is the engine (server/rounds/engine.py binds it).
        return cast("Orchestrator", self.owner.run)

    def check(self, node: Node, header: pb.UpdateHeader) -> RoundState:
        return self._check(node, header)[0]

    def _check(self, node: Node, header: pb.UpdateHeader) -> tuple[RoundState, SecAggRound]:
        """The open attempt and its secure round `header` answers; UpdateRejected if none."""
        try:
            wire_limits.check_update_header(header)
        except WireError as exc:
            raise UpdateRejected(exc.reason, str(exc)) from None
        orch = self._orch
        rnd = orch.current
        sround = self.owner.round if orch.current_plan is self.owner else None
        if rnd is None or rnd.number != header.round or sround is None:
            raise UpdateRejected(Reject.STALE_ROUND,
                                 f"round {header.round} is not an open secure round")
        if rnd.task_ids.get(node.node_id) != header.task_id:
            raise UpdateRejected(Reject.WRONG_TASK, f"task id {shown(header.task_id)} was not "
                                 f"given to {node.name} in round {rnd.number}")
        if rnd.slots.get(node.node_id) != SlotState.ASSIGNED:
            raise UpdateRejected(Reject.DUPLICATE,
                                 f"{node.name}'s part in round {rnd.number} is over")
        if not header.failed:
            why = sround.expects(node.node_id, header.kind)
            if why is not None:
                raise Untimely(why[0], f"{node.name}: {why[1]}")
        return rnd, sround

    def _refuse(self, node: Node, header: pb.UpdateHeader, exc: UpdateRejected,
                rnd: RoundState | None) -> None:
        orch = self._orch
        if not isinstance(exc, Untimely):
            orch.answers.reject(node, header, exc, rnd)
            return
        orch.history.count_rejection(exc.reason)
        current = orch.current
        if rnd is None and current is not None and current.number == header.round:
            rnd = current
        if rnd is not None:
            list_rejection(rnd, Rejection(node_id=node.node_id, node=node.name,
                                          round=header.round, reason=exc.reason,
                                          message=exc.message))
        log.warning("refused a secure-aggregation message from %s: %s", node.name, exc.message)

    async def ingest(self, node: Node, header: pb.UpdateHeader, receive: Receive,
                     transport: Transport) -> str:
        orch = self._orch
        rnd: RoundState | None = None
        try:
            rnd, sround = self._check(node, header)
            if header.failed:
                orch.answers.record_failure(node, header, rnd)
                return "failure recorded"
            async with receive(rnd) as got:
                if got is None:
                    raise UpdateRejected(Reject.MALFORMED, "a secure-aggregation message has a "
                                         "payload")
                if header.kind == pb.TASK_KIND_SECAGG_MASKED_INPUT:
                    rnd.upload_s[node.node_id] = got.seconds
                    rnd.upload_bytes[node.node_id] = header.payload_size
                    rnd.transport[node.node_id] = transport
                    rnd.bytes_received += header.payload_size
                try:
                    await sround.receive(node, header, got.payload)
                except SecAggError as exc:
                    raise UpdateRejected(Reject.MALFORMED, str(exc)) from None
        except UpdateRejected as exc:
            self._refuse(node, header, exc, rnd)
            raise
        node.transport = transport
        return f"secure aggregation {STAGE_OF[header.kind]} for round {header.round} accepted"
