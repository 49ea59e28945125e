"""Host-level slots: how many round workers may train at once on one host.

What Flower's simulation calls client resources. A CPU round takes one of `cpu_slots` (default:
the cores this process may use), so ten sampled nodes on a two-core host queue instead of
thrashing. A GPU round takes its share of its card: the node's `--gpu-memory-fraction`, or the
whole card without one, so four nodes capped at 0.25 train together on one GPU and a fifth waits.
A GPU round takes no CPU slot: it spends its time waiting on the GPU. Ring workers never come
here (every rank of a ring must run at once).

Pure bookkeeping, no processes and no clock: the worker factory (node/rounds/factory.py) decides
with
it. Shares are counted in thousandths so that 0.3 + 0.3 + 0.4 fills a card exactly.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)
_WHOLE = 1000


def default_cpu_slots() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Need:
    """What one round's worker holds while it runs."""

    device: str = "cpu"  # "cpu" or "cuda"
    gpu_uuid: str | None = None
    gpu_share: float | None = None  # of the card, in (0, 1]; None: the whole card

    def resource(self) -> str:
        return f"gpu:{self.gpu_uuid}" if self.device == "cuda" and self.gpu_uuid else "cpu"

    def units(self) -> int:
        if self.resource() == "cpu":
            return 1
        share = 1.0 if self.gpu_share is None else min(max(self.gpu_share, 0.001), 1.0)
        return max(1, round(share * _WHOLE))


@dataclass
class Slots(Generic[T]):
    """A FIFO queue per resource: a request starts when its resource has room, and never
    overtakes an earlier request for the same resource (a large GPU share is not starved by
    small ones)."""

    cpu_slots: int
    _used: dict[str, int] = field(default_factory=dict)
    _queue: deque[tuple[T, Need]] = field(default_factory=deque)
    _held: dict[T, Need] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cpu_slots < 1:
            raise ValueError(f"cpu slots must be at least 1, got {self.cpu_slots}")

    def capacity(self, resource: str) -> int:
        return self.cpu_slots if resource == "cpu" else _WHOLE

    def submit(self, item: T, need: Need) -> None:
        if item in self._held or any(i == item for i, _ in self._queue):
            raise ValueError(f"{item!r} is already queued or running")
        self._queue.append((item, need))

    def ready(self) -> list[T]:
        """Requests that may start now, in order; their slots are taken."""
        started: list[T] = []
        blocked: set[str] = set()
        waiting: deque[tuple[T, Need]] = deque()
        for item, need in self._queue:
            res = need.resource()
            used = self._used.get(res, 0)
            if res not in blocked and used + need.units() <= self.capacity(res):
                self._used[res] = used + need.units()
                self._held[item] = need
                started.append(item)
            else:
                blocked.add(res)
                waiting.append((item, need))
        self._queue = waiting
        return started

    def release(self, item: T) -> None:
        """A running request ended (or a queued one was given up): its slot is free again."""
        need = self._held.pop(item, None)
        if need is None:
            self._queue = deque((i, n) for i, n in self._queue if i != item)
            return
        res = need.resource()
        self._used[res] = self._used.get(res, 0) - need.units()

    def running(self) -> int:
        return len(self._held)

    def queued(self) -> int:
        return len(self._queue)

    def position(self, item: T) -> int:
        """How many requests wait ahead of `item` (-1: not queued)."""
        for i, (queued, _) in enumerate(self._queue):
            if queued == item:
                return i
        return -1
