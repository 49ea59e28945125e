"""Taking one update, whichever path carried its bytes: check its header against the open
round, claim the node's slot, receive the payload within the upload limits, validate it and
fold it into the round. PushUpdate (gRPC chunks) and the bulk port (server/transfer/bulk_server.py)
differ only in how the bytes arrive: the `receive` they pass in. Answers of a kind the job's
plan owns (secure aggregation's messages) go to the plan's own intake (server/rounds/intakes.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from google.protobuf.json_format import MessageToDict

from fedgpu.core.constants import Transport
from fedgpu.proto import pb
from fedgpu.server.registry import Node
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.buffered import next_step
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.intakes import Receive
from fedgpu.server.transfer import wire_limits
from fedgpu.server.transfer.wire_limits import WireError


def check_header(orch: Orchestrator, node: Node, header: pb.UpdateHeader) -> RoundState:
    """The open round `header` answers, once it is within bounds; UpdateRejected if not."""
    own = orch.plan.intake(header.kind)
    if own is not None:
        return own.check(node, header)
    try:
        wire_limits.check_update_header(header)
    except WireError as exc:
        raise UpdateRejected(exc.reason, str(exc)) from None
    return orch.answers.check_update(node, header)


def accepted_message(header: pb.UpdateHeader, again: bool = False) -> str:
    return f"update for round {header.round} {'already ' if again else ''}accepted"


async def ingest(orch: Orchestrator, node: Node, header: pb.UpdateHeader, receive: Receive,
                 transport: Transport, abort: Callable[[], None] | None = None,
                 quiet: Callable[[], float] | None = None,
                 told: Callable[[str], None] | None = None) -> str:
    """Take the update `header` announces; the reply's message. A refusal is counted, listed
    and raised as UpdateRejected; anything else that breaks off (the sender went away, the
    server stops) gives the slot back to the node, which may send again. `abort` ends this
    stream when the same node's retry takes its place (server/rounds/takeover.py; by
    default the calling task is cancelled) once `quiet()`, the seconds since it last received
    a byte, says it is dead (by default never). `told(message)`: the same message as soon as
    nothing can refuse the update any more, while its fold may still run (a path that can
    answer before it returns: the bulk port)."""
    own = orch.plan.intake(header.kind)
    if own is not None:
        return await own.ingest(node, header, receive, transport)
    if orch.answers.holders.already_accepted(header):
        # The node's retry of an update whose acknowledgement it never got: counted once.
        return accepted_message(header, again=True)
    if abort is None:
        abort = _cancel_current()
    await orch.answers.take_over(node, header)
    rnd: RoundState | None = None
    claimed = False
    holding: object = None
    try:
        # Async (FedBuff): an update that lands between two steps joins the next one.
        await next_step(orch, header.task_id, orch.job.round_deadline_s)
        rnd = check_header(orch, node, header)
        if header.ineligible:
            orch.answers.record_ineligible(node, header, rnd)
            return "ineligibility noted"
        if header.failed:
            orch.answers.record_failure(node, header, rnd)
            return "failure recorded"
        if header.HasField("decision"):
            # Decided for this task (the job's [resources], the GPUs now): the update's
            # record and `fedgpu nodes` show this one, not the one made at registration.
            node.decision = MessageToDict(header.decision, preserving_proto_field_name=True,
                                          always_print_fields_with_no_presence=True)
        # From here on this upload holds the node's slot; others are duplicates.
        orch.answers.claim(node, rnd)
        claimed = True
        holding = orch.answers.holders.hold(node.node_id, header.task_id, abort,
                                            quiet or (lambda: 0.0))
        async with receive(rnd) as got:
            tensors = None
            if got is not None:
                rnd.upload_s[node.node_id] = got.seconds
                rnd.upload_bytes[node.node_id] = header.payload_size
                rnd.transport[node.node_id] = transport
                spec = orch.answers.wire_spec if header.kind == pb.TASK_KIND_TRAIN else None
                tensors = await asyncio.to_thread(orch.links.decode, node.node_id,
                                                  header.kind, got.payload, spec,
                                                  lambda: orch.shared_weights, got.spooled,
                                                  got.finite)
            settled = None if told is None else (lambda: told(accepted_message(header)))
            try:
                await orch.answers.accept(node, header, rnd, tensors, header.payload_size,
                                          settled)
            except UpdateRejected as exc:
                # Async: the step closed while this update streamed; it joins the next one.
                if exc.reason != Reject.LATE or not await next_step(
                        orch, header.task_id, orch.job.round_deadline_s):
                    raise
                rnd = check_header(orch, node, header)
                orch.answers.claim(node, rnd)
                await orch.answers.accept(node, header, rnd, tensors, header.payload_size,
                                          settled)
            del tensors  # views of the payload, which is freed on the way out
    except UpdateRejected as exc:
        # A stream cut short is what a broken connection looks like on gRPC: refused, but its
        # slot is given back at once for the node's resume (server/transfer/uploads.py).
        orch.answers.reject(node, header, exc, rnd, claimed=claimed,
                            ends_part=exc.reason != Reject.TRUNCATED)
        raise
    except BaseException:
        if claimed and rnd is not None:
            orch.answers.release(node, rnd)
        raise
    finally:
        orch.answers.holders.let_go(node.node_id, holding)
    if got is not None:
        node.transport = transport
    return accepted_message(header)


def _cancel_current() -> Callable[[], None]:
    task = asyncio.current_task()
    return (lambda: None) if task is None else (lambda: task.cancel() and None)
