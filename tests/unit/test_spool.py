"""The spool for updates past the upload memory budget (server/transfer/spool.py) and the
paged decode of a spilled payload (server/rounds/paged.py), on real files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.paged import PagedTensors, decode_paged
from fedgpu.server.rounds.validation import decode_and_check
from fedgpu.server.transfer.spool import Spool, SpoolFile

TENSORS = {"a": np.arange(300_000, dtype=np.float32), "b": np.ones((7, 3), np.float32)}


def spooled(spool: Spool, enc: codec.Encoded, by_socket: bool) -> SpoolFile:
    f = spool.file(enc.size, enc.digest, codec.WIRE_DIGEST)
    asyncio.run(f.claim(1.0))
    data = memoryview(enc.to_bytes())
    if by_socket:  # tail/advance, in uneven reads
        while data.nbytes:
            tail = f.tail()
            n = min(tail.nbytes, data.nbytes, 100_001)
            tail[:n] = data[:n]
            f.advance(n)
            data = data[n:]
    else:
        for pos in range(0, data.nbytes, 70_000):
            f.add(bytes(data[pos:pos + 70_000]))
    return f


@pytest.mark.parametrize("by_socket", [False, True])
def test_a_spilled_payload_reads_back_checked_and_leaves_nothing(tmp_path: Path,
                                                                 by_socket: bool) -> None:
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool" / "upload-crashed").write_bytes(b"old")
    spool = Spool(tmp_path / "spool", 10 << 20, 1 << 20)
    assert spool.files() == []  # a crash's leftovers go at start
    enc = codec.encode(TENSORS)
    f = spooled(spool, enc, by_socket)
    assert spool.budget.used == enc.size and len(spool.files()) == 1
    payload = f.finish()
    assert bytes(payload) == enc.to_bytes()
    dropped: list[tuple[int, int]] = []

    def drop(begin: int, end: int) -> None:
        dropped.append((begin, end))
        f.drop(begin, end)

    paged = decode_paged(payload, codec.spec(TENSORS), drop)
    ref = decode_and_check(bytearray(enc.to_bytes()), codec.spec(TENSORS))
    assert isinstance(paged, PagedTensors) and paged.norms == ref.norms
    assert len(dropped) == 2  # each tensor's pages, once checked
    assert all(np.array_equal(paged[k], TENSORS[k]) for k in TENSORS)
    assert len(dropped) == 3  # reading b let a's pages go; a read again maps them back
    assert np.array_equal(paged["a"], TENSORS["a"])
    del paged, payload, ref
    f.release()
    assert spool.files() == [] and spool.budget.used == 0 and spool.budget.peak == enc.size


def test_a_damaged_or_oversized_spill_is_refused(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", 1 << 20, 1 << 20)
    enc = codec.encode(TENSORS)  # 1.2 MB: more than the whole spool
    with pytest.raises(UpdateRejected) as refused:
        spool.file(enc.size, enc.digest, codec.WIRE_DIGEST)
    assert refused.value.reason == Reject.TOO_LARGE and "spool" in refused.value.message
    small = codec.encode({"b": TENSORS["b"]})
    f = spool.file(small.size, "0" * 64, codec.WIRE_DIGEST)
    asyncio.run(f.claim(1.0))
    f.add(small.to_bytes())
    with pytest.raises(codec.DigestMismatch):
        f.finish()
    f.release()
    assert spool.files() == [] and spool.budget.used == 0


def test_the_spool_budget_is_strict_a_second_spill_waits_for_room(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", 1000, 1 << 20)

    async def run() -> tuple[bool, int]:
        first = spool.file(600, "", codec.WIRE_DIGEST)
        second = spool.file(600, "", codec.WIRE_DIGEST)
        await first.claim(1.0)
        with pytest.raises(TimeoutError):
            await second.claim(0.2)
        waiting = asyncio.create_task(second.claim(5.0))
        await asyncio.sleep(0.05)
        early = waiting.done()
        first.release()
        await waiting
        second.release()
        return early, spool.budget.peak

    early, peak = asyncio.run(run())
    assert not early and peak == 600
    assert spool.files() == [] and spool.budget.used == 0
