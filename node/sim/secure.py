"""A simulated node in a secure round: it takes part through the node layer's own protocol code
(node/secagg.py, on the same wire client), masking the simulator's synthetic step instead of a
trained change."""

from __future__ import annotations

import numpy as np

from fedgpu.node.secagg import Link, take_part
from fedgpu.node.wire_client import WireClient
from fedgpu.proto import pb


async def answer(wire: WireClient, node_id: str, poll_s: int, max_bytes: int,
                 task: pb.TaskHeader, like: pb.UpdateHeader, change: np.ndarray) -> str | None:
    """Answer a secure TRAIN task with the protocol; why it stopped, or None when it did not."""
    link = Link(wire, node_id, poll_s, max_bytes, lambda: False)
    return await take_part(link, task, like, change, float(like.num_examples))
