"""`fedgpu sim` in a secure round: a simulated node takes part through the node layer's own
protocol code (node/secagg.py, on the same wire client), masking the simulator's synthetic
step instead of a trained change."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np

from fedgpu.core import codec
from fedgpu.node.secagg import Link, take_part
from fedgpu.proto import pb

if TYPE_CHECKING:
    from fedgpu.cli.simnode import SimNode


def _change(node: SimNode, header: pb.TaskHeader, payload: memoryview) -> np.ndarray:
    """The simulator's synthetic step, flat in the protocol's layout (sorted names)."""
    tensors, _ = codec.decode(payload)
    scale = np.float32((1 + node.index % 7) / (1 + header.round))
    return np.concatenate([(node.noise.get(name, tensors[name].shape) * scale).reshape(-1)
                           for name in sorted(tensors)]).astype(np.float32, copy=False)


async def answer(node: SimNode, task: pb.TaskHeader, payload: memoryview,
                 like: pb.UpdateHeader) -> None:
    """Answer a secure TRAIN task with the protocol; a stop goes to the simulation's errors."""
    change = await asyncio.to_thread(_change, node, task, payload)
    link = Link(node.wire, node.node_id, node.cfg.poll_s, node.max_bytes, lambda: False)
    try:
        why = await take_part(link, task, like, change, float(like.num_examples))
    finally:
        node._note_fallback()
    if why is not None:
        node.stats.errors.append(f"{node.name}: {why}")
