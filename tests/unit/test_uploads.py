"""What an upload may hold: memory only as its bytes arrive, within one shared budget."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.server.transfer.uploads import ByteBudget
from tests.fixtures.wire import rss_mib


def test_an_announced_payload_takes_memory_only_as_it_arrives() -> None:
    before = rss_mib(os.getpid())
    asm = codec.Assembler(512 << 20, "0" * 64, limit=1 << 30)
    announced = rss_mib(os.getpid())
    asm.add(b"\x01" * (8 << 20))
    after_8 = rss_mib(os.getpid())
    assert announced - before < 16, (before, announced)  # not the 512 MiB announced
    assert 6 < after_8 - announced < 24, (announced, after_8)
    del asm


def test_a_completed_payload_decodes_without_a_copy() -> None:
    enc = codec.encode({"w": np.arange(1000, dtype=np.float32)})
    asm = codec.Assembler(enc.size, enc.digest, 1 << 20, enc.algorithm)
    for chunk in codec.iter_chunks(enc, 4096):
        asm.add(chunk)
    payload = asm.finish()
    tensors, _ = codec.decode(payload)
    assert np.array_equal(tensors["w"], np.arange(1000, dtype=np.float32))
    tensors["w"][0] = 7  # a view of the received buffer, writable
    assert codec.decode(payload)[0]["w"][0] == 7


def test_budget_is_first_come_first_served_and_never_too_small() -> None:
    async def go() -> list[str]:
        budget = ByteBudget(100)
        order: list[str] = []
        await budget.acquire(60, 1)

        async def take(name: str, size: int) -> None:
            await budget.acquire(size, 5)
            order.append(name)

        big = asyncio.create_task(take("big", 50))    # waits: 60 + 50 > 100
        await asyncio.sleep(0)
        small = asyncio.create_task(take("small", 10))  # would fit, but queues behind big
        await asyncio.sleep(0.05)
        assert order == [] and budget.waiting == 2
        budget.release(60)
        await asyncio.gather(big, small)
        assert budget.used == 60
        budget.release(60)
        # One reservation larger than the whole budget still goes through on its own.
        await budget.acquire(500, 1)
        assert budget.used == 500
        with pytest.raises(TimeoutError):
            await budget.acquire(1, 0.05)
        assert budget.waiting == 0  # a waiter that gave up leaves the queue
        budget.release(500)
        await budget.acquire(1, 0.05)
        return order

    assert asyncio.run(go()) == ["big", "small"]
