"""A node's side of secure aggregation, over the agent's own connection (PullTask/PushUpdate).

A TRAIN task whose header carries `secagg_setup` is trained as usual; then, instead of its
weights, the node sends the protocol's messages (fedgpu/core/secagg/site.py decides what they
say), each as an update of the stage's kind whose payload is the message's bytes, and pulls
the aggregator's relay of the next stage as a task of that kind for the same task id. What it
masks is its change to the model (trained - received), weighted by its example count, which
never leaves the node in the clear.

It stops when the protocol is done, when its site refuses a step (the failure is reported),
when the aggregator abandons the task (the round closed) or when the agent stops. A task of
another round that arrives meanwhile is handed back to the agent to run next.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from fedgpu.core import codec
from fedgpu.core.secagg import layout
from fedgpu.core.secagg.errors import SecAggError, Stage
from fedgpu.core.secagg.messages import KeyRelay, Setup, ShareRelay, UnmaskRequest
from fedgpu.core.secagg.site import SiteSession
from fedgpu.node.client import AggregatorClient, PayloadError
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node.secagg")

KIND_OF = {
    Stage.ADVERTISE_KEYS: pb.TASK_KIND_SECAGG_ADVERTISE_KEYS,
    Stage.SHARE_KEYS: pb.TASK_KIND_SECAGG_SHARE_KEYS,
    Stage.MASKED_INPUT: pb.TASK_KIND_SECAGG_MASKED_INPUT,
    Stage.UNMASK: pb.TASK_KIND_SECAGG_UNMASK,
}
Pulled = tuple[pb.TaskHeader, bytearray | None]


class Interrupted(Exception):
    """The protocol cannot go on for this node (abandoned, stopped, another task came)."""

    def __init__(self, message: str, next_task: Pulled | None = None) -> None:
        super().__init__(message)
        self.next_task = next_task


@dataclass
class Link:
    """What the protocol needs of the agent."""

    client: AggregatorClient
    node_id: str
    poll_s: int
    max_bytes: int
    workdir: Path
    # Set when the aggregator abandons the task (heartbeats) or the agent stops.
    cancelled: Callable[[], bool]


def take_part(link: Link, task: pb.TaskHeader, update: pb.UpdateHeader,
              received: bytes | bytearray | memoryview, trained: Path) -> Pulled | None:
    """Run the protocol for `task` (trained: the round's weights, `update` their header);
    returns a task of another round pulled meanwhile, for the agent to run next."""
    started = time.monotonic()
    stage = Stage.SETUP
    try:
        session = SiteSession(Setup.decode(bytes(task.secagg_setup)))
        change = layout.delta(codec.read_file(trained), codec.decode(received)[0])
        weight = float(update.num_examples)
        stage = Stage.ADVERTISE_KEYS
        _send(link, task, stage, session.advertise().encode())
        stage = Stage.SHARE_KEYS
        relay = KeyRelay.decode(_wait(link, task, stage))
        _send(link, task, stage, session.share_keys(relay).encode())
        stage = Stage.MASKED_INPUT
        shares = ShareRelay.decode(_wait(link, task, stage))
        masked = session.masked_input(shares, change, weight).encode()
        del change
        _send(link, task, stage, masked, update)
        del masked
        stage = Stage.UNMASK
        request = UnmaskRequest.decode(_wait(link, task, stage))
        _send(link, task, stage, session.unmask(request).encode())
    except SecAggError as exc:
        # This site refused a step or could not read a message: say so, and it is out.
        log.warning("round %d: secure aggregation stopped at %s: %s", task.round, stage, exc)
        failed = pb.UpdateHeader(node_id=link.node_id, task_id=task.task_id, round=task.round,
                                 kind=KIND_OF.get(stage, pb.TASK_KIND_SECAGG_ADVERTISE_KEYS),
                                 failed=True, error=f"secure aggregation, {stage}: {exc}")
        _push(link, failed, None)
        return None
    except Interrupted as exc:
        log.warning("round %d: secure aggregation ended at %s: %s", task.round, stage, exc)
        return exc.next_task
    except (grpc.RpcError, PayloadError) as exc:
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        log.warning("round %d: secure aggregation ended at %s: %s", task.round, stage, detail)
        return None
    log.info("round %d: secure aggregation done in %.1fs", task.round,
             time.monotonic() - started)
    return None


def _send(link: Link, task: pb.TaskHeader, stage: Stage, data: bytes | bytearray,
          like: pb.UpdateHeader | None = None) -> None:
    header = pb.UpdateHeader()
    if like is not None:
        # The masked input carries the round's metrics and resources like a plain update;
        # its example count (the weight) travels masked inside the payload only.
        header.CopyFrom(like)
        header.num_examples = 0
    header.node_id, header.task_id, header.round = link.node_id, task.task_id, task.round
    header.kind = KIND_OF[stage]
    path = link.workdir / f"secagg-{stage}.bin"
    path.write_bytes(data)
    try:
        _push(link, header, path)
    finally:
        path.unlink(missing_ok=True)


def _push(link: Link, header: pb.UpdateHeader, payload: Path | None) -> None:
    # A refusal (grpc.RpcError) ends this node's part: the caller stops.
    link.client.push(header, payload)


def _wait(link: Link, task: pb.TaskHeader, stage: Stage) -> bytes:
    """The payload of the aggregator's relay for `stage`, for this task."""
    kind = KIND_OF[stage]
    while True:
        if link.cancelled():
            raise Interrupted("the aggregator closed the round (or the agent stops)")
        header, payload = link.client.pull(link.node_id, link.poll_s, link.max_bytes)
        if header.kind == pb.TASK_KIND_NONE:
            continue
        if header.task_id != task.task_id:
            raise Interrupted(f"a new task arrived ({header.task_id[:8]})", (header, payload))
        if header.kind != kind:
            # An earlier task of this round served again before the aggregator saw our
            # answer: wait a moment for the relay we need.
            time.sleep(0.2)
            continue
        return bytes(payload or b"")

