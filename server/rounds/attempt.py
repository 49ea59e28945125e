"""One open round attempt: who was asked, what they answered, until it closes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fedgpu.core.constants import RoundStatus, Transport
from fedgpu.proto import pb
from fedgpu.server.rounds.records import (
    Failure,
    Ineligibility,
    Rejection,
    RoundRecord,
    UpdateRecord,
)
from fedgpu.server.rounds.states import SlotState
from fedgpu.server.strategies.aggregate import weighted_metric
from fedgpu.server.transfer.payload import ModelPayload

# A slot is open while its node's answer may still come (or is still arriving).
_OPEN = frozenset({SlotState.ASSIGNED, SlotState.UPLOADING})


class RunFailed(Exception):
    """The run cannot go on; the message says why and what to do."""


@dataclass
class Task:
    """A task handed to one node; re-served on a re-pull so a dropped stream loses nothing.
    `payload`: the global model it sends (None for tasks without one)."""

    task_id: str
    round: int
    kind: int
    header: pb.TaskHeader
    payload: ModelPayload | None


@dataclass
class RoundState:
    number: int
    kind: int
    attempt: int
    required: int
    deadline: float
    started: float
    slots: dict[str, SlotState] = field(default_factory=dict)
    task_ids: dict[str, str] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    updates: list[UpdateRecord] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    rejected_not_listed: int = 0
    failures: list[Failure] = field(default_factory=list)
    # Nodes that answered they cannot take the job now: an attempt they sink costs no retry.
    ineligible: list[Ineligibility] = field(default_factory=list)
    # Ring mode: the ranks each failed node says the ring lost (UpdateHeader.lost_ranks).
    lost_ranks: dict[str, list[int]] = field(default_factory=dict)
    # Why an attempt with enough updates still failed (its result was not finite).
    error: str | None = None
    # When the first participant failed or was refused (ring mode stops waiting soon after).
    first_failure_at: float | None = None
    bytes_received: int = 0
    # Seconds the strategy spent on this round (streaming adds + finish), and each node's
    # upload time as the aggregator saw it: `fedgpu report` splits a round's duration by them.
    aggregation_s: float = 0.0
    upload_s: dict[str, float] = field(default_factory=dict)
    # Each node's upload size: with upload_s, the rate `fedgpu rounds` shows after it ended.
    upload_bytes: dict[str, int] = field(default_factory=dict)
    # The path each node's update came by (bulk port or gRPC).
    transport: dict[str, Transport] = field(default_factory=dict)
    # Async (FedBuff): done as soon as this many updates were accepted (0: when all answered).
    enough: int = 0

    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.slots.values() if s == state)

    def accepted(self) -> int:
        return self.count(SlotState.ACCEPTED)

    def outstanding(self) -> int:
        return sum(1 for s in self.slots.values() if s in _OPEN)

    def waiting_on(self) -> list[str]:
        """Node ids still expected to answer (or whose answer is still arriving)."""
        return [nid for nid, s in self.slots.items() if s in _OPEN]

    def hopeless(self) -> bool:
        """Some node answered "ineligible" and the others can no longer make up `required`:
        closing now (and opening another attempt without it) beats waiting for the deadline."""
        return bool(self.ineligible) and self.accepted() + self.outstanding() < self.required

    def in_state(self, state: SlotState) -> list[str]:
        return sorted(nid for nid, s in self.slots.items() if s == state)

    def settle(self, node_id: str, state: SlotState, now: float) -> None:
        """Record a node's final state in this attempt; done once nobody is outstanding."""
        self.slots[node_id] = state
        if state in (SlotState.FAILED, SlotState.REJECTED) and self.first_failure_at is None:
            self.first_failure_at = now
        if self.outstanding() == 0 or self.enough and self.accepted() >= self.enough:
            self.done.set()

    def record(self, status: RoundStatus, now: float) -> RoundRecord:
        """The closed attempt as its round record (`fedgpu rounds --json`)."""
        return RoundRecord(
            round=self.number,
            attempt=self.attempt,
            status=status,
            started_at=self.started,
            duration_s=round(now - self.started, 3),
            participants=sorted(self.slots),
            nodes_reporting=self.accepted(),
            dropped=self.in_state(SlotState.DROPPED),
            train_loss=weighted_metric([(u.train_metrics["loss"], u.num_examples)
                                        for u in self.updates if "loss" in u.train_metrics]),
            num_examples=sum(u.num_examples for u in self.updates),
            bytes_received=self.bytes_received,
            aggregation_s=round(self.aggregation_s, 4),
            updates=self.updates,
            rejected=self.rejected,
            failures=self.failures,
            rejected_not_listed=self.rejected_not_listed,
            error=self.error,
            ineligible=self.ineligible,
        )
