"""A node's retry takes the place of its own broken upload.

A site whose upload connection broke (a reset it saw and the aggregator did not, a NAT that
forgot the flow) sends again at once, while the aggregator may still wait on the dead
connection until its idle timeout: its slot says "uploading", and the retry would be refused
as a duplicate of itself. So the stream that holds a node's slot leaves a way to end it here,
and a new answer from the same node to the same task waits for the old stream: if that one
finishes, the new one is a duplicate (or acknowledged, below); if it received nothing for
STALE_S, it is dead, and the new answer ends it and claims the slot it gives back. A live
stream is never cut by a copy of itself, so a node that sends one update on many streams at
once still has exactly one of them counted. A different node cannot do this: the slot is looked
up by the authenticated node's id, and only for the task id that node was given.

And a retry of an update already accepted (the acknowledgement was lost with the connection)
is acknowledged again when its payload digest is the accepted one, never counted twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from fedgpu.core import digests
from fedgpu.proto import pb

# How long a retry waits for the stream it replaces to finish or give the slot back.
TAKEOVER_S = 10.0
# A stream holding a slot that received nothing for this long is taken to be dead.
STALE_S = 1.0
POLL_S = 0.02
# Accepted digests remembered (task id -> digest), oldest forgotten first.
MAX_ACCEPTED = 100_000


def digest_of(header: pb.UpdateHeader) -> str:
    try:
        return digests.of_header(header)[1]
    except digests.UnknownDigest:
        return ""


@dataclass
class Holders:
    """Which stream holds each node's slot (node id -> task id, how to end it), and the
    digests of accepted updates by task id."""

    # node id -> (task id, end the stream, seconds since it last received a byte)
    _held: dict[str, tuple[str, Callable[[], None], Callable[[], float]]] = field(
        default_factory=dict)
    _accepted: dict[str, str] = field(default_factory=dict)
    taken_over: int = 0

    def hold(self, node_id: str, task_id: str, abort: Callable[[], None],
             quiet: Callable[[], float]) -> object:
        entry = (task_id, abort, quiet)
        self._held[node_id] = entry
        return entry

    def let_go(self, node_id: str, entry: object) -> None:
        if entry is not None and self._held.get(node_id) is entry:
            del self._held[node_id]

    async def take_over(self, node_id: str, task_id: str, uploading: Callable[[], bool]
                        ) -> None:
        """Wait (up to TAKEOVER_S) while a stream holds `node_id`'s slot for `task_id`
        (`uploading()`), ending it once it has been silent for STALE_S."""
        loop = asyncio.get_running_loop()
        end = loop.time() + TAKEOVER_S
        ended = False
        while uploading() and loop.time() < end:
            held = self._held.get(node_id)
            if held is None or held[0] != task_id:
                return
            if not ended and held[2]() >= STALE_S:
                self.taken_over += 1
                held[1]()
                ended = True
            await asyncio.sleep(POLL_S)

    def accepted(self, header: pb.UpdateHeader) -> None:
        digest = digest_of(header)
        if digest:
            self._accepted[header.task_id] = digest
            while len(self._accepted) > MAX_ACCEPTED:
                del self._accepted[next(iter(self._accepted))]

    def already_accepted(self, header: pb.UpdateHeader) -> bool:
        """Is this the update already accepted for its task (same payload digest)?"""
        digest = digest_of(header)
        return bool(digest) and self._accepted.get(header.task_id) == digest
