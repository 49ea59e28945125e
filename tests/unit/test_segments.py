"""Segment digests (fedgpu/core/segments.py) on every receiver that checks them: the node's and
the aggregator's Assembler, the simulated node's DigestSink and the aggregator's spool; with the
wire's digest, BLAKE3_SEGMENTS (fedgpu/core/segment_hasher.py: one pass for both), and with
plain "blake3" from older senders (two passes).

Threat model: bytes damaged on the way are refused at the segment they touch, naming it; a
broken transfer keeps only verified segments, so a resume never builds on unchecked bytes; a
header announcing the wrong number of digests, or (BLAKE3_SEGMENTS) digests that do not hash to
its payload digest, is refused before anything is received.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import blake3
import numpy as np
import pytest

from fedgpu.core import codec, segment_hasher, segments
from fedgpu.core.digest_sink import DigestSink
from fedgpu.core.segments import SEGMENT_BYTES, SegmentCountError, SegmentMismatch, segment_bytes
from tests.fixtures.feeding import feed

ALGO = codec.DigestAlgo.BLAKE3_SEGMENTS
BOTH = pytest.mark.parametrize("algo", [codec.DigestAlgo.BLAKE3_SEGMENTS,
                                        codec.DigestAlgo.BLAKE3])


def _independent(data: bytes) -> tuple[str, bytes]:
    """BLAKE3_SEGMENTS by its rule, with nothing of fedgpu: (digest, segment digests)."""
    seg = segment_bytes(len(data))
    segs = b"".join(blake3.blake3(data[i:i + seg]).digest() for i in range(0, len(data), seg))
    return blake3.blake3(segs).hexdigest(), segs


def _payload(size: int, algo: codec.DigestAlgo = ALGO) -> tuple[bytes, str, bytes]:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    root, segs = _independent(data)
    return data, root if algo is ALGO else blake3.blake3(data).hexdigest(), segs


@pytest.mark.parametrize(("size", "seg"), [(0, 1 << 10), (10, 1 << 10), (150_000, 4 << 10),
                                         (21 << 20, 512 << 10), ((32 << 20) - 1, 512 << 10),
                                         (32 << 20, 1 << 20), (5 << 30, 1 << 20)])
def test_a_payload_has_at_least_32_segments_up_to_1_mib_each(size: int, seg: int) -> None:
    # A cut re-sends at most one segment: at most 1/32 of a small payload (issue 37's 5%).
    assert segment_bytes(size) == seg
    assert segments.count(size) == -(-size // seg)
    assert size < 32 * (1 << 10) or size >= 32 << 20 or segments.count(size) >= 32


@pytest.mark.parametrize("threads", [1, 2])
def test_the_digest_is_blake3_of_the_segment_digests_however_the_payload_is_laid_out(
        threads: int) -> None:
    data, root, digests = _payload(3 * SEGMENT_BYTES + 1000)
    seg = segment_bytes(len(data))
    views = [memoryview(data)[:10], memoryview(data)[10:seg + 7], memoryview(data)[seg + 7:]]
    assert segment_hasher.of_views(views, threads) == (root, digests)
    assert len(digests) == segments.count(len(data)) * segments.DIGEST_BYTES
    # Fed in pieces that straddle the segments, as a receiver's reads are.
    h = codec.hasher(ALGO, size=len(data))
    for pos in range(0, len(data), 300_001):
        h.update(memoryview(data)[pos:pos + 300_001])
    assert h.hexdigest() == root and h.segment_digests() == digests  # type: ignore[attr-defined]
    assert root != blake3.blake3(data).hexdigest()  # not plain BLAKE3: an algorithm of its own
    # A break after the last byte: every segment verified, nothing to forget.
    checked_h = segment_hasher.SegmentHasher(len(data), digests)
    checked_h.update(data)
    assert checked_h.rewind() == len(data) and checked_h.hexdigest() == root


@pytest.mark.parametrize("cut", [1 << 20, 3 * (1 << 20) + 7, 8 << 20])
def test_a_received_payload_hashed_on_several_threads_checks_and_rewinds_as_on_one(
        cut: int) -> None:
    """A received payload's whole segments are hashed several at a time where the machine has
    the cores: the same digests, the same verified end after every read, and a bad segment
    named at the same place, as one thread gives."""
    data, root, digests = _payload(12 * (1 << 20) + 1000)
    assert segment_bytes(len(data)) >= segment_hasher.PARALLEL_MIN_SEGMENT
    bad = bytearray(data)
    bad[9 * segment_bytes(len(data)) + 5] ^= 1
    for payload in (data, bytes(bad)):
        seen = []
        for threads in (1, 4):
            h = segment_hasher.SegmentHasher(len(data), digests, threads=threads)
            ends: list[int | str] = []
            try:
                for pos in range(0, len(payload), cut):
                    h.update(memoryview(payload)[pos:pos + cut])
                    ends.append(h.verified)
            except codec.CodecError as exc:
                ends.append(str(exc))
            seen.append((ends, h.verified, h.segment_digests(), h.rewind()))
        assert seen[0] == seen[1]
        if payload is data:
            assert seen[0][0][-1] == len(data) and h.hexdigest() == root
        else:
            assert "segment 9" in str(seen[0][0][-1]), seen[0][0][-1]
            assert seen[0][3] == 9 * segment_bytes(len(data))


def test_a_forked_child_hashes_on_threads_of_its_own() -> None:
    """The node's factory forks round workers: a hashing pool the parent made has no threads
    in the child, which must make its own instead of waiting on the parent's forever."""
    data, root, digests = _payload(12 * (1 << 20))
    segment_hasher.SegmentHasher(len(data), digests, threads=2).update(data)  # the parent's pool
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if it hashed it right
        h = segment_hasher.SegmentHasher(len(data), digests, threads=2)
        h.update(data)
        os._exit(0 if h.hexdigest() == root else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, done


def test_encode_gives_the_digest_and_the_segment_digests_in_one_pass() -> None:
    enc = codec.encode({"a": np.arange(300_000, dtype=np.float64), "b": np.ones(7, np.int8)})
    assert enc.algorithm is ALGO and segments.count(enc.size) > 2
    assert (enc.digest, enc.segment_digests) == _independent(enc.to_bytes())


def test_the_empty_payload_is_blake3_of_the_empty_string(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "e").write_bytes(b"")
    want = blake3.blake3(b"").hexdigest()
    assert codec.file_digests(tmp_path / "e", ALGO) == (want, b"")
    assert segment_hasher.of_views([]) == (want, b"")
    asm = codec.Assembler(0, want, 1 << 20, ALGO)
    assert bytes(asm.finish()) == b""


def test_a_file_has_the_digests_of_its_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data, root, digests = _payload(SEGMENT_BYTES + 5)
    path = tmp_path / "u.safetensors"
    path.write_bytes(data)
    assert codec.file_digests(path, ALGO) == (root, digests) == segment_hasher.of_file(path)
    assert codec.digest_file(path, ALGO) == root
    assert codec.digest_file(path, codec.DigestAlgo.BLAKE3) == blake3.blake3(data).hexdigest()


def test_a_header_whose_segments_do_not_hash_to_its_digest_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each of the digests may be a segment's true one: the list still has to be the one the
    payload digest names, or a verified segment would be one the whole digest disowns."""
    from fedgpu.server.transfer.spool import Spool

    size = 2 * SEGMENT_BYTES + 3
    _, root, digests = _payload(size)
    other = blake3.blake3(b"another payload").hexdigest()
    swapped = digests[32:64] + digests[:32] + digests[64:]
    for expected, announced in ((other, digests), (root, swapped)):
        with pytest.raises(codec.CodecError, match="segment digests hash to") as err:
            codec.Assembler(size, expected, 1 << 40, ALGO, segment_digests=announced)
        assert err.value.reason == "malformed"
        with pytest.raises(codec.CodecError, match="segment digests hash to"):
            DigestSink(size, expected, ALGO, segment_digests=announced)
        with pytest.raises(codec.CodecError, match="segment digests hash to"):
            Spool(tmp_path, 1 << 30, 1 << 20).file(size, expected, ALGO, announced)
    # The same list under plain BLAKE3 (an older sender) is checked segment by segment only.
    codec.Assembler(size, other, 1 << 40, codec.DigestAlgo.BLAKE3, segment_digests=digests)


@pytest.mark.parametrize("announced", [31, 32, 3 * 32, 65_537 * 32])
def test_a_header_with_the_wrong_number_of_digests_is_refused(announced: int) -> None:
    size = 2 * SEGMENT_BYTES + 1  # 33 segments of 64 KiB
    with pytest.raises(SegmentCountError, match="has 33 segments of 65536 bytes"):
        codec.Assembler(size, "00" * 32, 1 << 40, ALGO, segment_digests=b"x" * announced)
    assert SegmentCountError.reason == "malformed"


@pytest.mark.parametrize("pipelined", [False, True])
@BOTH
def test_a_broken_transfer_rewinds_to_its_last_verified_segment(pipelined: bool,
                                                                 algo: codec.DigestAlgo) -> None:
    size = (40 << 20) + 123 if pipelined else 3 * SEGMENT_BYTES + 123
    data, whole, digests = _payload(size, algo)
    asm = codec.Assembler(size, whole, 1 << 40, algo, segment_digests=digests)
    seg = segment_bytes(size)
    cut = 2 * seg + seg // 3
    feed(asm, data, cut, 10_000)
    assert asm.rewind() == 2 * seg == asm.received
    feed(asm, data, size, 300_000)  # the resume, from the verified offset
    assert bytes(asm.finish()) == data
    asm.release()


@BOTH
def test_a_damaged_segment_is_refused_naming_it(algo: codec.DigestAlgo) -> None:
    size = 3 * SEGMENT_BYTES  # 48 segments of 64 KiB
    data, whole, digests = _payload(size, algo)
    bad = bytearray(data)
    bad[(64 << 10) + 17] ^= 1
    asm = codec.Assembler(size, whole, 1 << 40, algo, segment_digests=digests)
    with pytest.raises(SegmentMismatch, match=r"segment 1 of 48 \(bytes 65536-131072\)"):
        feed(asm, bytes(bad), size, 4096)
    assert SegmentMismatch.reason == "digest"
    # Cut there instead: the damaged segment is not kept, the verified one before it is.
    assert asm.rewind() == 64 << 10
    asm.release()


@BOTH
def test_the_digest_sink_keeps_only_verified_segments_too(algo: codec.DigestAlgo) -> None:
    size = 4 * SEGMENT_BYTES + 9
    data, whole, digests = _payload(size, algo)
    sink = DigestSink(size, whole, algo, block=300_000, segment_digests=digests)
    seg = segment_bytes(size)
    feed(sink, data, 3 * seg - 5, 7_000)
    assert sink.rewind() == 2 * seg
    feed(sink, data, size, 70_000)
    sink.finish()


@BOTH
def test_the_spool_keeps_only_verified_segments_too(tmp_path, algo) -> None:  # type: ignore[no-untyped-def]
    from fedgpu.server.transfer.spool import Spool

    size = 3 * SEGMENT_BYTES + 1
    data, whole, digests = _payload(size, algo)
    spool = Spool(tmp_path, 1 << 30, 1 << 20)
    f = spool.file(size, whole, algo, digests)
    asyncio.run(f.claim(5))
    seg = segment_bytes(size)
    feed(f, data, seg + 10, 5_000)  # type: ignore[arg-type]
    assert f.rewind() == seg
    feed(f, data, size, 50_000)  # type: ignore[arg-type]
    assert bytes(f.finish()) == data
    f.release()


@BOTH
def test_without_segment_digests_every_byte_held_is_kept(algo: codec.DigestAlgo) -> None:
    """An older sender announces none: the resume offset is the bytes held, as before."""
    size = 2 * SEGMENT_BYTES
    data, whole, _ = _payload(size, algo)
    asm = codec.Assembler(size, whole, 1 << 40, algo)
    feed(asm, data, 12_345, 1000)
    assert asm.rewind() == 12_345
    feed(asm, data, size, 1 << 20)
    asm.finish()
    asm.release()


def test_more_segments_than_the_bound_are_refused_even_when_the_count_fits() -> None:
    """A payload past MAX_SEGMENTS segments travels with its whole digest only."""
    n = segments.MAX_SEGMENTS + 1
    with pytest.raises(SegmentCountError, match="at most 65536 segments"):
        segments.checked(n * SEGMENT_BYTES, b"\0" * (32 * n))
    assert segments.checked(SEGMENT_BYTES, b"") == b""
