"""Segment digests (fedgpu/core/segments.py) on every receiver that checks them: the node's and
the aggregator's Assembler, the simulated node's DigestSink and the aggregator's spool.

Threat model: bytes damaged on the way are refused at the segment they touch, naming it; a
broken transfer keeps only verified segments, so a resume never builds on unchecked bytes; a
header announcing the wrong number of digests is refused before anything is received.
"""

from __future__ import annotations

import asyncio

import blake3
import numpy as np
import pytest

from fedgpu.core import bulk, codec, segments
from fedgpu.core.segments import SEGMENT_BYTES, SegmentCountError, SegmentMismatch

ALGO = codec.DigestAlgo.BLAKE3


def _payload(size: int) -> tuple[bytes, str, bytes]:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    return data, blake3.blake3(data).hexdigest(), segments.of_views([memoryview(data)])


def _feed(asm: codec.Assembler | bulk.DigestSink, data: bytes, end: int, step: int) -> None:
    """As a socket would: straight into tail(), `step` bytes a read."""
    while asm.received < end:
        tail = asm.tail()
        n = min(step, end - asm.received, tail.nbytes)
        tail[:n] = data[asm.received:asm.received + n]
        tail.release()
        asm.advance(n)


def test_the_digests_are_blake3_of_each_segment_however_the_payload_is_laid_out() -> None:
    data, _, digests = _payload(3 * SEGMENT_BYTES + 1000)
    views = [memoryview(data)[:10], memoryview(data)[10:SEGMENT_BYTES + 7],
             memoryview(data)[SEGMENT_BYTES + 7:]]
    assert segments.of_views(views) == digests
    assert len(digests) == 4 * segments.DIGEST_BYTES
    want = b"".join(blake3.blake3(data[i:i + SEGMENT_BYTES]).digest()
                    for i in range(0, len(data), SEGMENT_BYTES))
    assert digests == want


def test_a_file_has_the_digests_of_its_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data, _, digests = _payload(SEGMENT_BYTES + 5)
    path = tmp_path / "u.safetensors"
    path.write_bytes(data)
    assert segments.of_file(path) == digests


@pytest.mark.parametrize("announced", [31, 32, 3 * 32, 65_537 * 32])
def test_a_header_with_the_wrong_number_of_digests_is_refused(announced: int) -> None:
    size = 2 * SEGMENT_BYTES
    with pytest.raises(SegmentCountError, match="has 2 segments"):
        codec.Assembler(size, "00" * 32, 1 << 40, ALGO, segment_digests=b"x" * announced)
    assert SegmentCountError.reason == "malformed"


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_broken_transfer_rewinds_to_its_last_verified_segment(pipelined: bool) -> None:
    size = (40 << 20) + 123 if pipelined else 3 * SEGMENT_BYTES + 123
    data, whole, digests = _payload(size)
    asm = codec.Assembler(size, whole, 1 << 40, ALGO, segment_digests=digests)
    cut = 2 * SEGMENT_BYTES + SEGMENT_BYTES // 3
    _feed(asm, data, cut, 100_000)
    assert asm.rewind() == 2 * SEGMENT_BYTES == asm.received
    _feed(asm, data, size, 300_000)  # the resume, from the verified offset
    assert bytes(asm.finish()) == data
    asm.release()


def test_a_damaged_segment_is_refused_naming_it() -> None:
    size = 3 * SEGMENT_BYTES
    data, whole, digests = _payload(size)
    bad = bytearray(data)
    bad[SEGMENT_BYTES + 17] ^= 1
    asm = codec.Assembler(size, whole, 1 << 40, ALGO, segment_digests=digests)
    with pytest.raises(SegmentMismatch, match=r"segment 1 of 3 \(bytes 1048576-2097152\)"):
        _feed(asm, bytes(bad), size, 65_536)
    assert SegmentMismatch.reason == "digest"
    # Cut there instead: the damaged segment is not kept, the verified one before it is.
    assert asm.rewind() == SEGMENT_BYTES
    asm.release()


def test_the_digest_sink_keeps_only_verified_segments_too() -> None:
    size = 4 * SEGMENT_BYTES + 9
    data, whole, digests = _payload(size)
    sink = bulk.DigestSink(size, whole, ALGO, block=300_000, segment_digests=digests)
    _feed(sink, data, 3 * SEGMENT_BYTES - 5, 70_000)
    assert sink.rewind() == 2 * SEGMENT_BYTES
    _feed(sink, data, size, 70_000)
    sink.finish()


def test_the_spool_keeps_only_verified_segments_too(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fedgpu.server.transfer.spool import Spool

    size = 3 * SEGMENT_BYTES + 1
    data, whole, digests = _payload(size)
    spool = Spool(tmp_path, 1 << 30, 1 << 20)
    f = spool.file(size, whole, ALGO, digests)
    asyncio.run(f.claim(5))
    _feed(f, data, SEGMENT_BYTES + 10, 50_000)  # type: ignore[arg-type]
    assert f.rewind() == SEGMENT_BYTES
    _feed(f, data, size, 50_000)  # type: ignore[arg-type]
    assert bytes(f.finish()) == data
    f.release()


def test_without_segment_digests_every_byte_held_is_kept() -> None:
    """An older sender announces none: the resume offset is the bytes held, as before."""
    size = 2 * SEGMENT_BYTES
    data, whole, _ = _payload(size)
    asm = codec.Assembler(size, whole, 1 << 40, ALGO)
    _feed(asm, data, 12_345, 1000)
    assert asm.rewind() == 12_345
    _feed(asm, data, size, 1 << 20)
    asm.finish()
    asm.release()


def test_more_segments_than_the_bound_are_refused_even_when_the_count_fits() -> None:
    """A payload past MAX_SEGMENTS segments travels with its whole digest only."""
    n = segments.MAX_SEGMENTS + 1
    with pytest.raises(SegmentCountError, match="at most 65536 segments"):
        segments.checked(n * SEGMENT_BYTES, b"\0" * (32 * n))
    assert segments.checked(SEGMENT_BYTES, b"") == b""
