"""A node's secure-aggregation message arriving as an update (kinds TASK_KIND_SECAGG_*), by
either path: checked against the open attempt, its payload handed to the round's driver.

A message the driver cannot use (undecodable, another site's index, a protocol violation) is
refused like a bad update: listed, counted, and the node's part in the attempt is over. One
that is only repeated or late is refused and listed, and the site stays as the protocol has it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fedgpu.core.constants import Transport
from fedgpu.core.secagg.errors import SecAggError
from fedgpu.proto import pb
from fedgpu.server.registry import Node
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.records import Rejection, list_rejection
from fedgpu.server.rounds.states import SlotState
from fedgpu.server.secagg.driver import STAGE_OF, SecAggRound
from fedgpu.server.transfer import wire_limits
from fedgpu.server.transfer.wire_limits import WireError, shown

if TYPE_CHECKING:
    from fedgpu.server.rounds.engine import Orchestrator
    from fedgpu.server.rounds.receive import Receive

log = logging.getLogger("fedgpu.server.secagg")

SECAGG_KINDS = frozenset(STAGE_OF)


def check(orch: Orchestrator, node: Node, header: pb.UpdateHeader
          ) -> tuple[RoundState, SecAggRound]:
    """The open attempt and its secure round `header` answers; UpdateRejected if none."""
    try:
        wire_limits.check_update_header(header)
    except WireError as exc:
        raise UpdateRejected(exc.reason, str(exc)) from None
    rnd = orch.current
    sround = getattr(orch.current_plan, "round", None)
    if rnd is None or rnd.number != header.round or not isinstance(sround, SecAggRound):
        raise UpdateRejected(Reject.STALE_ROUND, f"round {header.round} is not an open secure "
                             "round")
    if rnd.task_ids.get(node.node_id) != header.task_id:
        raise UpdateRejected(Reject.WRONG_TASK, f"task id {shown(header.task_id)} was not "
                             f"given to {node.name} in round {rnd.number}")
    if rnd.slots.get(node.node_id) != SlotState.ASSIGNED:
        raise UpdateRejected(Reject.DUPLICATE, f"{node.name}'s part in round {rnd.number} is "
                             "over")
    if not header.failed:
        why = sround.expects(node.node_id, header.kind)
        if why is not None:
            raise Untimely(why[0], f"{node.name}: {why[1]}")
    return rnd, sround


class Untimely(UpdateRejected):
    """A message repeated, or too late for its stage: refused, but it does not end the
    site's part (the protocol already counts it as dropped at that stage, or has its
    message)."""


def _refuse(orch: Orchestrator, node: Node, header: pb.UpdateHeader, exc: UpdateRejected,
            rnd: RoundState | None) -> None:
    if not isinstance(exc, Untimely):
        orch.reject(node, header, exc, rnd)
        return
    orch.history.count_rejection(exc.reason)
    current = orch.current
    rnd = rnd or (current if current is not None and current.number == header.round else None)
    if rnd is not None:
        list_rejection(rnd, Rejection(node_id=node.node_id, node=node.name, round=header.round,
                                      reason=exc.reason, message=exc.message))
    log.warning("refused a secure-aggregation message from %s: %s", node.name, exc.message)


async def ingest(orch: Orchestrator, node: Node, header: pb.UpdateHeader, receive: Receive,
                 transport: Transport) -> str:
    rnd: RoundState | None = None
    try:
        rnd, sround = check(orch, node, header)
        if header.failed:
            orch.record_failure(node, header, rnd)
            return "failure recorded"
        async with receive(rnd) as got:
            if got is None:
                raise UpdateRejected(Reject.MALFORMED, "a secure-aggregation message has a "
                                     "payload")
            if header.kind == pb.TASK_KIND_SECAGG_MASKED_INPUT:
                rnd.upload_s[node.node_id] = got.seconds
                rnd.transport[node.node_id] = transport
                rnd.bytes_received += header.payload_size
            try:
                await sround.receive(node, header, got.payload)
            except SecAggError as exc:
                raise UpdateRejected(Reject.MALFORMED, str(exc)) from None
    except UpdateRejected as exc:
        _refuse(orch, node, header, exc, rnd)
        raise
    node.transport = transport
    return f"secure aggregation {STAGE_OF[header.kind]} for round {header.round} accepted"
