"""Training updates into the strategy, several at once when they arrive together.

The weighted sum is bound by memory traffic: one update at a time costs a read of the update
and a read and write of the sum (BLAS axpy, ~1.5x the read-once bound), two or more folded
together share that pass over the sum (1.2-1.3x on K = 10 x 11M, BENCHMARKS.md section 12).
Updates arrive together when it matters: the sites of a round finishing at once, their
uploads queueing behind the one being folded. So each update waits on the round's
aggregation lock as before, and whoever gets it folds every update then waiting for the same
open round in one call (flat combining); the others find theirs done when their turn comes.

Nothing is held longer than before: every update is folded before its upload's buffers are
given back (its receiver waits for it, cancelled or not), and the lock is released only when
the fold has finished (a cancelled holder waits for its thread first). An update in a fold is
recorded even if its receiver was cancelled meanwhile: it is in the sum.

Its sender need not wait for the sum, though: once an update is in a fold that cannot refuse
it (validated, dense, the round open under the lock, a strategy that sums by examples alone)
its verdict is settled, and `told` lets the receiver say so while the sum is written (the
bulk port's verdict goes out then; a 512 MiB update's fold is ~0.07 s of its ~0.35 s upload
on loopback, BENCHMARKS.md section 18). The update is recorded, and its round may close, only
once the fold has finished, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.work import fold_updates, sums_by_examples
from fedgpu.server.strategies.base import Strategy

log = logging.getLogger("fedgpu.server")


@dataclass(eq=False)
class Waiting:
    """One accepted training update waiting to be folded into its round's sum."""

    rnd: RoundState
    tensors: Mapping[str, Any]
    num_examples: int
    train_metrics: Mapping[str, float]
    staleness: int
    # Called (on the event loop) once this update is in a fold that cannot refuse it.
    told: Callable[[], None] | None = None
    taken: bool = False  # in a fold now (its own or another update's holder's)
    error: BaseException | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class FoldQueue:
    def __init__(self, lock: asyncio.Lock) -> None:
        self._lock = lock
        self._waiting: list[Waiting] = []

    async def fold(self, strategy: Strategy, entry: Waiting) -> None:
        """Fold `entry` (with whatever waits beside it); raises what its fold raised:
        UpdateRejected LATE when its round closed first."""
        self._waiting.append(entry)
        try:
            await self._take_turns(strategy, entry)
        except asyncio.CancelledError:
            if not entry.taken:
                self._waiting.remove(entry)
                raise
            # In a fold: its tensors are being read, so its caller must not free them before
            # the end; and once folded the update is in the sum, so its receiver must go on
            # to record it (were its node to send it again, it would count twice).
            await _wait_out(asyncio.ensure_future(entry.finished.wait()))
            if entry.error is not None:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        if entry.error is not None:
            raise entry.error

    async def _take_turns(self, strategy: Strategy, entry: Waiting) -> None:
        while True:
            async with self._lock:
                if entry.taken:
                    return  # folded by the update ahead of it
                if _room(entry.rnd) > 0 or entry.rnd.closed:
                    await self._fold_batch(strategy, entry)
                    return
            # Its asynchronous step holds its buffer already and is about to be aggregated:
            # once it closes this update is late, and its receiver sends it on to the next
            # step (server/rounds/receive.py).
            await _until_closed(entry.rnd)
            if not entry.rnd.closed:  # past the step's deadline: refused like any late one
                self._waiting.remove(entry)
                entry.taken = True
                entry.error = _late(entry.rnd)
                entry.finished.set()
                return

    async def _fold_batch(self, strategy: Strategy, entry: Waiting) -> None:
        rnd = entry.rnd
        room = _room(rnd)
        others = [e for e in self._waiting if e.rnd is rnd and e is not entry]
        batch = [entry, *others[:max(room - 1, 0)]]
        for e in batch:
            e.taken = True
            self._waiting.remove(e)
        cancelled = False
        try:
            if rnd.closed:
                for e in batch:
                    e.error = _late(rnd)
                return
            if sums_by_examples(strategy):
                for e in batch:
                    if e.told is not None and _dense(e.tensors):
                        _tell(e.told)
            t0 = time.perf_counter()
            items = [(e.tensors, e.num_examples, e.train_metrics, e.staleness) for e in batch]
            fut = asyncio.ensure_future(asyncio.to_thread(fold_updates, strategy, items))
            cancelled = await _wait_out(fut)
            rnd.aggregation_s += time.perf_counter() - t0
            try:
                errors: list[BaseException | None] = list(fut.result())
            except Exception as exc:  # noqa: BLE001 - every update of the fold gets it
                errors = [exc] * len(batch)
            for e, err in zip(batch, errors, strict=True):
                e.error = err
        finally:
            for e in batch:
                e.finished.set()
        if cancelled:
            raise asyncio.CancelledError


def _tell(told: Callable[[], None]) -> None:
    try:
        told()
    except Exception:  # noqa: BLE001 - the sender then hears when the fold is done
        log.exception("could not send an update's verdict ahead of its fold")


def _dense(tensors: Mapping[str, Any]) -> bool:
    # Compressed updates' block sources decode as they fold: theirs is told when it is done.
    return all(isinstance(t, np.ndarray) for t in tensors.values())


def _late(rnd: RoundState) -> UpdateRejected:
    return UpdateRejected(Reject.LATE, f"round {rnd.number} closed before aggregation")


def _room(rnd: RoundState) -> int:
    """How many more updates the round takes: an asynchronous step exactly its buffer
    (rnd.enough; every update folded before is settled by now), a synchronous round all."""
    return rnd.enough - rnd.accepted() if rnd.enough else 1 << 30


async def _until_closed(rnd: RoundState) -> None:
    # The engine closes a full step as soon as it gets the lock; bounded by the step's
    # deadline all the same.
    while not rnd.closed and time.time() < rnd.deadline:
        await asyncio.sleep(0.01)


async def _wait_out(fut: asyncio.Future[Any]) -> bool:
    """Wait for `fut` to end even if the caller is cancelled meanwhile; True if it was.

    A thread folding received buffers must finish before they are freed and before the lock
    lets the next fold start, so a cancelled receiver (its node hung up) still waits here."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled
