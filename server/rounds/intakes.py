"""How a node's answer is taken. A path (gRPC chunks, the bulk port) passes in a `Receive` for
the payload; a plan may supply an `Intake` for answers of kinds it owns beyond plain updates
(secure aggregation's messages: server/secagg/intake.py, owned by server/secagg/plan.py).
Plain updates are server/rounds/receive.py's, which asks the job's plan first
(`Plan.intake`), so the round engine knows no protocol that rides on it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from fedgpu.core.constants import Transport
from fedgpu.proto import pb
from fedgpu.server.registry import Node
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.transfer.uploads import Received

# What a path does to hand over the payload: an async context manager yielding it (None for
# an answer that carries no weights), for the round it answers.
Receive = Callable[[RoundState], AbstractAsyncContextManager[Received | None]]


class Intake(Protocol):
    """Takes a plan's own kinds of answer, by either path."""

    def check(self, node: Node, header: pb.UpdateHeader) -> RoundState:
        """The open attempt `header` answers, once it is within bounds; UpdateRejected if
        not (OpenUpload asks this before it hands out a bulk ticket)."""

    async def ingest(self, node: Node, header: pb.UpdateHeader, receive: Receive,
                     transport: Transport) -> str:
        """Take the answer; the reply's message. A refusal is counted, listed and raised as
        UpdateRejected."""
