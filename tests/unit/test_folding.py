"""Training updates folded into the strategy several at once (server/rounds/folding.py): real
asyncio, real strategies and their weighted sums, real worker threads."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from fedgpu.proto import pb
from fedgpu.server.rejections import UpdateRejected
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.folding import FoldQueue, Waiting
from fedgpu.server.strategies.fedavg import FedAvg
from fedgpu.server.strategies.fednova import FedNova
from fedgpu.server.strategies.update import UpdateIn

GLOBAL = {"w": np.zeros(4096, np.float32)}


class Counting(FedAvg):
    """FedAvg that records how many updates each sweep took."""

    def __init__(self) -> None:
        super().__init__()
        self.sweeps: list[int] = []

    def add_many(self, updates: Sequence[UpdateIn]) -> None:
        self.sweeps.append(len(updates))
        super().add_many(updates)


def _round(number: int = 1) -> RoundState:
    return RoundState(number=number, kind=pb.TASK_KIND_TRAIN, attempt=1, required=1,
                      deadline=time.time() + 60, started=time.time())


def _start(strategy: FedAvg, number: int = 1) -> tuple[asyncio.Lock, FoldQueue, RoundState]:
    """A round's aggregation lock, its fold queue and the open round, strategy begun."""
    lock = asyncio.Lock()
    strategy.begin_round(GLOBAL)
    return lock, FoldQueue(lock), _round(number)


def _update(rnd: RoundState, value: float, n: int, steps: float | None = 5.0) -> Waiting:
    metrics = {} if steps is None else {"steps": steps}
    return Waiting(rnd, {"w": np.full(4096, value, np.float32)}, n, metrics, 0)


def test_updates_waiting_together_fold_in_one_sweep_into_the_right_mean() -> None:
    async def main() -> tuple[list[int], np.ndarray]:
        strategy = Counting()
        lock, folds, rnd = _start(strategy)
        async with lock:  # the update ahead of them is being folded
            tasks = [asyncio.create_task(folds.fold(strategy, _update(rnd, v, n)))
                     for v, n in ((1.0, 10), (2.0, 30), (4.0, 60))]
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        return strategy.sweeps, strategy.finish()["w"]

    sweeps, mean = asyncio.run(main())
    assert sweeps == [3]
    np.testing.assert_allclose(mean, (1 * 10 + 2 * 30 + 4 * 60) / 100, rtol=1e-6)


def test_a_round_that_closed_first_refuses_its_waiting_updates_as_late() -> None:
    async def main() -> list[BaseException | None]:
        strategy = Counting()
        lock, folds, rnd = _start(strategy, 7)
        async with lock:
            tasks = [asyncio.create_task(folds.fold(strategy, _update(rnd, 1.0, 5)))
                     for _ in range(2)]
            await asyncio.sleep(0.05)
            rnd.closed = True  # the round's finish got the lock before them
        got = await asyncio.gather(*tasks, return_exceptions=True)
        assert strategy.sweeps == []
        return got

    for err in asyncio.run(main()):
        assert isinstance(err, UpdateRejected) and "round 7 closed before aggregation" in str(err)


def test_each_update_keeps_its_own_refusal_where_they_fold_one_by_one() -> None:
    # FedNova weighs by each update's steps: no shared sweep; the one without steps is
    # refused alone, its neighbour still lands.
    async def main() -> tuple[list[BaseException | None], FedNova]:
        strategy = FedNova()
        lock, folds, rnd = _start(strategy)
        async with lock:
            tasks = [asyncio.create_task(folds.fold(strategy, _update(rnd, 1.0, 5, steps)))
                     for steps in (None, 4.0)]
            await asyncio.sleep(0.05)
        return list(await asyncio.gather(*tasks, return_exceptions=True)), strategy

    (first, second), strategy = asyncio.run(main())
    assert isinstance(first, UpdateRejected) and "needs the update's local steps" in str(first)
    assert second is None
    assert strategy._examples == [5.0]  # noqa: SLF001 - what the sum took


def test_a_cancelled_update_not_yet_taken_is_never_folded() -> None:
    async def main() -> list[int]:
        strategy = Counting()
        lock, folds, rnd = _start(strategy)
        async with lock:
            gone = asyncio.create_task(folds.fold(strategy, _update(rnd, 9.0, 5)))
            kept = asyncio.create_task(folds.fold(strategy, _update(rnd, 1.0, 5)))
            await asyncio.sleep(0.05)
            gone.cancel()  # its node hung up while it waited
            await asyncio.sleep(0.05)
        await kept
        with pytest.raises(asyncio.CancelledError):
            await gone
        np.testing.assert_allclose(strategy.finish()["w"], 1.0)
        return strategy.sweeps

    assert asyncio.run(main()) == []  # one update left: folded alone (add), no sweep


class Blocking(Counting):
    """A sweep that waits for the test to let it go."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.go = threading.Event()

    def add_many(self, updates: Sequence[UpdateIn]) -> None:
        self.entered.set()
        assert self.go.wait(30)
        super().add_many(updates)


def test_a_cancelled_holder_holds_the_lock_until_its_fold_ends_and_its_updates_are_kept() -> None:
    async def main() -> None:
        strategy = Blocking()
        lock, folds, rnd = _start(strategy)
        async with lock:
            tasks = [asyncio.create_task(folds.fold(strategy, _update(rnd, v, 5)))
                     for v in (1.0, 3.0)]
            await asyncio.sleep(0.05)
        await asyncio.to_thread(strategy.entered.wait, 30)
        for t in tasks:
            t.cancel()  # both receivers give up while the thread reads their tensors
        await asyncio.sleep(0.2)
        # Neither returned (their buffers would be freed) and no other fold could start.
        assert not any(t.done() for t in tasks) and lock.locked()
        strategy.go.set()
        # Both were folded: their receivers go on to record them (a resend would count
        # twice), so the cancellation ends here.
        assert await asyncio.gather(*tasks) == [None, None]
        assert not lock.locked()
        np.testing.assert_allclose(strategy.finish()["w"], 2.0)

    asyncio.run(main())


def test_an_asynchronous_step_folds_exactly_its_buffer_and_the_rest_are_late() -> None:
    # buffer_size 2 (rnd.enough): of four updates waiting together two fold, the other two
    # are refused as late (their receivers then send them to the next step).
    from fedgpu.server.rounds.states import SlotState

    async def main() -> tuple[list[int], list[BaseException | None]]:
        strategy = Counting()
        lock, folds, rnd = _start(strategy, 3)
        rnd.enough = 2
        rnd.slots = {f"n{i}": SlotState.UPLOADING for i in range(4)}

        async def answer(i: int) -> None:  # as Answers.accept does: settle once folded
            await folds.fold(strategy, _update(rnd, float(i), 5))
            rnd.settle(f"n{i}", SlotState.ACCEPTED, time.time())

        async def close_when_full() -> None:  # as the engine does, under the lock
            await rnd.done.wait()
            async with lock:
                rnd.closed = True

        closer = asyncio.create_task(close_when_full())
        async with lock:
            tasks = [asyncio.create_task(answer(i)) for i in range(4)]
            await asyncio.sleep(0.05)
        got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        await closer
        return strategy.sweeps, got

    sweeps, got = asyncio.run(main())
    assert sweeps == [2]
    assert got[:2] == [None, None]
    for err in got[2:]:
        assert isinstance(err, UpdateRejected) and err.reason == "late", err


def test_a_sender_is_told_once_its_update_is_in_a_fold_that_cannot_refuse_it() -> None:
    # `told` comes while the sweep still runs (the bulk port's verdict goes out then), for
    # every update of a shared sweep; their folds end afterwards as before.
    async def main() -> None:
        strategy = Blocking()
        lock, folds, rnd = _start(strategy)
        told: list[float] = []
        entries = [_update(rnd, v, 5) for v in (1.0, 3.0)]
        for e in entries:
            e.told = lambda v=e: told.append(float(v.tensors["w"][0]))
        async with lock:
            tasks = [asyncio.create_task(folds.fold(strategy, e)) for e in entries]
            await asyncio.sleep(0.05)
            assert told == []  # waiting for the lock: the round may still close first
        await asyncio.to_thread(strategy.entered.wait, 30)
        assert sorted(told) == [1.0, 3.0]
        assert not any(t.done() for t in tasks)
        strategy.go.set()
        assert await asyncio.gather(*tasks) == [None, None]
        np.testing.assert_allclose(strategy.finish()["w"], 2.0)

    asyncio.run(main())


def test_no_one_is_told_early_where_the_fold_may_still_refuse() -> None:
    # FedNova may refuse an update at its fold (no local steps); a round closed first makes
    # its waiting updates late; a compressed update's blocks decode as it folds. None of
    # these hears before its fold's outcome.
    from fedgpu.core.update_codecs import Int8Tensor

    async def main() -> list[object]:
        told: list[str] = []
        nova = FedNova()
        lock, folds, rnd = _start(nova)
        refused = _update(rnd, 1.0, 5, steps=None)
        refused.told = lambda: told.append("nova")
        got: list[object] = [await asyncio.gather(folds.fold(nova, refused),
                                                  return_exceptions=True)]
        fedavg = Counting()
        lock, folds, rnd = _start(fedavg, 7)
        late = _update(rnd, 1.0, 5)
        late.told = lambda: told.append("late")
        async with lock:
            task = asyncio.create_task(folds.fold(fedavg, late))
            await asyncio.sleep(0.05)
            rnd.closed = True
        got.append(await asyncio.gather(task, return_exceptions=True))
        lock, folds, rnd = _start(fedavg, 8)
        q = np.full(4096, 2, np.int8)
        packed = Waiting(rnd, {"w": Int8Tensor(q, np.array([0.5], np.float32), (4096,))}, 5,
                         {}, 0, told=lambda: told.append("int8"))
        got.append(await folds.fold(fedavg, packed))
        np.testing.assert_allclose(fedavg.finish()["w"], 1.0)
        assert told == []
        return got

    (nova,), (late,), packed = asyncio.run(main())
    assert isinstance(nova, UpdateRejected) and "local steps" in str(nova)
    assert isinstance(late, UpdateRejected) and late.reason == "late"
    assert packed is None
