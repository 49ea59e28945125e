"""`fedgpu sim` in a secure round: a simulated node's side of secure aggregation.

The same site state machine as a real node (fedgpu/core/secagg/site.py) and the same wire client
(node/wire_client.py: updates and tasks of the TASK_KIND_SECAGG_* kinds, payloads over the bulk
port or gRPC), on the simulator's asyncio loop; the masked change is the simulator's synthetic
step. The cryptography and the masking run in a thread, so a few hundred simulated sites share
the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc
import numpy as np

from fedgpu.core import bulk, codec
from fedgpu.core.secagg.errors import SecAggError, Stage
from fedgpu.core.secagg.messages import KeyRelay, Setup, ShareRelay, UnmaskRequest
from fedgpu.core.secagg.site import SiteSession
from fedgpu.node.wire_client import PayloadError
from fedgpu.proto import pb

if TYPE_CHECKING:
    from fedgpu.cli.simnode import SimNode

log = logging.getLogger("fedgpu.sim")

KIND_OF = {
    Stage.ADVERTISE_KEYS: pb.TASK_KIND_SECAGG_ADVERTISE_KEYS,
    Stage.SHARE_KEYS: pb.TASK_KIND_SECAGG_SHARE_KEYS,
    Stage.MASKED_INPUT: pb.TASK_KIND_SECAGG_MASKED_INPUT,
    Stage.UNMASK: pb.TASK_KIND_SECAGG_UNMASK,
}


def _change(node: SimNode, header: pb.TaskHeader, payload: memoryview) -> np.ndarray:
    """The simulator's synthetic step, flat in the protocol's layout (sorted names)."""
    tensors, _ = codec.decode(payload)
    scale = np.float32((1 + node.index % 7) / (1 + header.round))
    return np.concatenate([(node.noise.get(name, tensors[name].shape) * scale).reshape(-1)
                           for name in sorted(tensors)]).astype(np.float32, copy=False)


def _digest(data: bytes | bytearray) -> str:
    h = codec.hasher(codec.WIRE_DIGEST, all_cores=True)
    h.update(data)
    return str(h.hexdigest())


async def _send(node: SimNode, task: pb.TaskHeader, stage: Stage, data: bytes | bytearray,
                like: pb.UpdateHeader | None = None) -> None:
    update = pb.UpdateHeader()
    if like is not None:
        update.CopyFrom(like)
    update.node_id, update.task_id, update.round = node.node_id, task.task_id, task.round
    update.kind, update.num_examples = KIND_OF[stage], 0
    digest = await asyncio.to_thread(_digest, data)
    source = codec.Encoded((memoryview(data),), len(data), digest, codec.WIRE_DIGEST)
    try:
        await node.wire.push(update, source)
    finally:
        node._note_fallback()


async def _wait(node: SimNode, task: pb.TaskHeader, stage: Stage, deadline: float) -> bytes:
    while time.monotonic() < deadline:
        # Relays are kept whatever the simulation does with models (--update-file drops them).
        pulled = await node.wire.pull(node.node_id, node.cfg.poll_s, node.max_bytes)
        try:
            header = pulled.header
            if header.kind == pb.TASK_KIND_NONE:
                continue
            if header.task_id != task.task_id or header.kind != KIND_OF[stage]:
                raise SecAggError(f"got a task of kind {header.kind} waiting for {stage}")
            return bytes(pulled.payload or b"")
        finally:
            if isinstance(pulled.receiver, codec.Assembler):
                pulled.receiver.release()
    raise SecAggError(f"no {stage} relay in time")


async def take_part(node: SimNode, task: pb.TaskHeader, payload: memoryview,
                    like: pb.UpdateHeader) -> None:
    """Answer a secure TRAIN task with the protocol; errors go to the simulation's stats."""
    deadline = time.monotonic() + 3 * task.secagg_stage_timeout_s + 600
    stage = Stage.SETUP
    try:
        site = SiteSession(Setup.decode(bytes(task.secagg_setup)))
        change = await asyncio.to_thread(_change, node, task, payload)
        weight = 10 + node.index % 90
        stage = Stage.ADVERTISE_KEYS
        await _send(node, task, stage, site.advertise().encode())
        stage = Stage.SHARE_KEYS
        relay = KeyRelay.decode(await _wait(node, task, stage, deadline))
        await _send(node, task, stage, (await asyncio.to_thread(site.share_keys, relay)).encode())
        stage = Stage.MASKED_INPUT
        shares = ShareRelay.decode(await _wait(node, task, stage, deadline))
        masked = await asyncio.to_thread(site.masked_input, shares, change, weight)
        del change
        await _send(node, task, stage, await asyncio.to_thread(masked.encode), like)
        del masked
        stage = Stage.UNMASK
        request = UnmaskRequest.decode(await _wait(node, task, stage, deadline))
        await _send(node, task, stage, site.unmask(request).encode())
    except (SecAggError, grpc.RpcError, PayloadError, bulk.RefusedError, OSError,
            bulk.BulkProtocolError) as exc:
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        node.stats.errors.append(f"{node.name} secure aggregation at {stage}: {detail}")
