"""The finite check taken as an upload's verified bytes land (fedgpu/core/finite_scan.py), and
the hashing pipeline it rides on (fedgpu/core/digest_pipe.py), against the check after the
last byte (server/rounds/validation.py) that it replaces on the bulk path.

Threat model: a sender whose update holds NaN or Inf, or whose bytes are damaged on the way,
or who forges a header. The scan must refuse exactly what the check after the last byte
refuses and accept exactly what it accepts: an update with a NaN is refused naming the tensor;
bytes that fail their segment digest are never part of the scan (a resume after them re-sends
them, and the scan covers the re-sent bytes, not the damaged ones); a header the scan cannot
parse leaves the whole check to the end, which refuses it as before. Nothing here trusts the
scan's result unless the whole-payload digest matched first (finish()).
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from fedgpu.core import codec, finite_scan
from fedgpu.core.digest_pipe import PIPELINE_MIN_BYTES, PipelinedDigest
from fedgpu.core.segments import SegmentMismatch, segment_bytes
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.validation import decode_and_check, finite_norms
from tests.fixtures.feeding import feed

ALGO = codec.DigestAlgo.BLAKE3_SEGMENTS


def _tensors(rng_seed: int = 0) -> dict[str, np.ndarray]:
    """Past PIPELINE_MIN_BYTES (the hashing thread, and so the scan, start there), with every
    kind of tensor the scan must handle or pass over."""
    rng = np.random.default_rng(rng_seed)
    return {
        "a_big": rng.standard_normal(9 << 20, dtype=np.float32),          # 36 MiB
        "b_half": rng.standard_normal(300_001).astype(np.float16),       # odd byte count
        "c_bf16": rng.standard_normal(70_001).astype(ml_dtypes.bfloat16),
        "d_ints": rng.integers(0, 9, 50_001, dtype=np.int64),            # not checked
        "e_empty": np.zeros((0, 4), np.float32),
        "f_scalar": np.float64(2.5) * np.ones((), np.float64),
        "g_wide": rng.standard_normal((513, 1025)),                      # float64
    }


def _receive(enc: codec.Encoded, data: bytes | None = None, step: int = 3_000_017
             ) -> tuple[codec.Assembler, memoryview]:
    asm = codec.Assembler(enc.size, enc.digest, 1 << 40, ALGO,
                          segment_digests=enc.segment_digests, scan=True)
    feed(asm, memoryview(data or enc.to_bytes()), enc.size, step)
    return asm, asm.finish()


def test_the_scan_finds_what_the_check_after_the_last_byte_finds() -> None:
    tensors = _tensors()
    enc = codec.encode(tensors)
    assert enc.size >= PIPELINE_MIN_BYTES
    asm, payload = _receive(enc)
    got = asm.finite()
    assert got is not None and got.bad is None
    norms, bad = finite_norms(codec.decode(payload)[0])
    assert bad is None
    assert got.names == tuple(sorted(tensors))
    # The same tensors measured (integers and the empty one are not), the same norms up to
    # float32 rounding (the dots run over other chunks of the data): both near the exact one.
    assert set(got.norms) == set(norms) == {"a_big", "b_half", "c_bf16", "f_scalar", "g_wide"}
    for name, value in norms.items():
        exact = float(np.linalg.norm(tensors[name].astype(np.float64)))
        assert got.norms[name] == pytest.approx(exact, rel=1e-4)
        assert value == pytest.approx(exact, rel=1e-4)
    normed = decode_and_check(payload, codec.spec(tensors), got)
    assert normed.norms == got.norms  # the scan's norms, no second read of the update
    assert np.array_equal(normed["a_big"], tensors["a_big"])
    del normed, payload
    asm.release()


@pytest.mark.parametrize(("where", "value"), [("a_big", np.inf), ("g_wide", np.nan),
                                              ("c_bf16", np.nan), ("b_half", -np.inf)])
def test_a_non_finite_value_is_refused_naming_its_tensor(where: str, value: float) -> None:
    tensors = _tensors(1)
    flat = tensors[where].reshape(-1)
    flat[flat.size // 2] = value
    asm, payload = _receive(codec.encode(tensors))
    got = asm.finite()
    assert got is not None and got.bad == where
    assert finite_norms(codec.decode(payload)[0])[1] == where
    with pytest.raises(UpdateRejected, match=f"tensor '{where}' contains NaN or Inf") as err:
        decode_and_check(payload, codec.spec(tensors), got)
    assert err.value.reason == Reject.NON_FINITE
    del payload
    asm.release()


@pytest.mark.parametrize("cut", [False, True])
def test_damaged_bytes_are_never_part_of_the_scan(cut: bool) -> None:
    """A NaN that arrives in a segment whose digest does not match is not the update's: the
    transfer breaks there (the segment refused, or the connection cut before the segment was
    complete), resumes from the last verified segment, and the scan of the whole (re-sent)
    payload finds every value finite."""
    tensors = _tensors(2)
    enc = codec.encode(tensors)
    clean = enc.to_bytes()
    damaged = bytearray(clean)
    seg = segment_bytes(enc.size)
    at = (20 << 20) + seg // 2  # inside a_big, in the middle of a segment
    damaged[at:at + 4] = np.array([np.nan], np.float32).tobytes()
    asm = codec.Assembler(enc.size, enc.digest, 1 << 40, ALGO,
                          segment_digests=enc.segment_digests, scan=True)
    if cut:
        # Cut a little after the NaN: its segment never completed, so it was never checked;
        # what was hashed of it must not have been scanned either.
        feed(asm, memoryview(bytes(damaged)), at + 1000, 700_001)
    else:
        with pytest.raises(SegmentMismatch):
            feed(asm, memoryview(bytes(damaged)), enc.size, 1 << 20)
    # The break: back to the end of the last verified segment, before the damage.
    assert asm.rewind() == at // seg * seg
    feed(asm, memoryview(clean), enc.size, 5_000_011)
    payload = asm.finish()
    got = asm.finite()
    assert got is not None and got.bad is None
    exact = float(np.linalg.norm(tensors["a_big"].astype(np.float64)))
    assert got.norms["a_big"] == pytest.approx(exact, rel=1e-4)
    del payload
    asm.release()


def test_a_header_the_scan_cannot_parse_is_left_to_the_check_at_the_end() -> None:
    """A forged header (tensors that overlap) whose digests match: no scan result, and the
    decode after the last byte refuses it as it always did."""
    size = PIPELINE_MIN_BYTES + 4096
    head = (b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
            b'"y":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}')
    head += b" " * (-len(head) % 8)
    body = len(head).to_bytes(8, "little") + head
    data = body + bytes(size - len(body))
    root, segs = _digests(data)
    asm = codec.Assembler(size, root, 1 << 40, ALGO, segment_digests=segs, scan=True)
    feed(asm, memoryview(data), size, 1 << 20)
    payload = asm.finish()
    assert asm.finite() is None
    with pytest.raises(UpdateRejected) as err:
        decode_and_check(payload, None, asm.finite())
    assert err.value.reason == Reject.MALFORMED
    del payload
    asm.release()


def test_a_scan_of_other_tensors_is_not_used() -> None:
    """decode_and_check trusts a scan only when it covers exactly the tensors it decoded."""
    tensors = {"w": np.array([1.0, np.nan], np.float32)}
    stranger = finite_scan.FiniteResult(("v",), {"v": 1.0}, None)
    with pytest.raises(UpdateRejected, match="tensor 'w' contains NaN"):
        decode_and_check(codec.encode(tensors).to_bytes(), None, stranger)


def test_small_payloads_and_gRPC_chunks_are_checked_after_the_last_byte() -> None:
    """Below PIPELINE_MIN_BYTES nothing is hashed on a thread, so nothing is scanned there; nor
    are gRPC chunks (hashed as they are copied in) or a node's download (no scan asked)."""
    enc = codec.encode({"w": np.ones(1000, np.float32)})
    asm, payload = _receive(enc)
    assert asm.finite() is None
    del payload
    asm.release()
    big = codec.encode(_tensors(3))
    asm = codec.Assembler(big.size, big.digest, 1 << 40, ALGO,
                          segment_digests=big.segment_digests, scan=True)
    for chunk in codec.iter_chunks(big, 4 << 20):
        asm.add(chunk)
    asm.finish()
    assert asm.finite() is None
    asm.release()
    asm = codec.Assembler(big.size, big.digest, 1 << 40, ALGO,
                          segment_digests=big.segment_digests)
    feed(asm, memoryview(big.to_bytes()), big.size, 4 << 20)
    asm.finish()
    assert asm.finite() is None
    asm.release()


def test_the_hashing_thread_stops_at_a_failed_block_until_it_is_reported() -> None:
    """With several blocks queued, the ones behind a block whose hash failed are not hashed (a
    digest's verified offset must not move past damage); once wait() has reported the
    failure, hashing goes on (the resume after a rewind)."""
    gate = threading.Event()
    seen: list[bytes] = []

    class Digest:
        def update(self, data: bytes | memoryview, /) -> None:
            gate.wait(10)
            if bytes(data) == b"bad":
                raise SegmentMismatch("damaged")
            seen.append(bytes(data))

        def hexdigest(self) -> str:
            return ""

    pipe = PipelinedDigest(Digest(), depth=4)
    for block in (b"1", b"bad", b"3", b"4"):
        pipe.update(block)
    gate.set()
    with pytest.raises(SegmentMismatch):
        pipe.wait()
    assert seen == [b"1"]
    pipe.update(b"5")
    pipe.wait()
    assert seen == [b"1", b"5"]
    pipe.close()


def _digests(data: bytes) -> tuple[str, bytes]:
    from fedgpu.core.segment_hasher import of_views

    return of_views([memoryview(data)])


@pytest.mark.parametrize("poison", [False, True])
def test_the_aggregators_bulk_upload_hands_the_scan_to_validation(poison: bool) -> None:
    """The upload path end to end over a real socket (server/transfer/uploads.py reading a
    bulk connection): the received payload carries the scan, and validation takes it, the
    clean update with the scan's norms, the poisoned one refused as non-finite."""
    import asyncio
    import socket
    import time

    from fedgpu.core import bulk, digests
    from fedgpu.proto import pb
    from fedgpu.server.transfer.uploads import Uploads

    tensors = _tensors(4)
    if poison:
        tensors["g_wide"][7, 9] = np.nan
    enc = codec.encode(tensors)
    header = pb.UpdateHeader(payload_size=enc.size, payload_segment_digests=enc.segment_digests)
    digests.stamp(header, codec.WIRE_DIGEST, enc.digest)

    async def scenario() -> tuple[finite_scan.FiniteResult | None, str]:
        uploads = Uploads(1 << 30, budget_bytes=1 << 30, idle_s=10)
        a, b = socket.socketpair()

        async def blocking(fn, *args):  # type: ignore[no-untyped-def]
            return await asyncio.to_thread(fn, *args)

        async def send() -> None:
            await asyncio.to_thread(bulk.read_status, a)
            await asyncio.to_thread(bulk.send_payload, a, enc.segments)

        sender = asyncio.create_task(send())
        try:
            async with uploads.receive_socket("n", header, b, time.time() + 30, blocking,
                                              "ticket-1") as got:
                await sender
                try:
                    normed = decode_and_check(got.payload, codec.spec(tensors), got.finite)
                    verdict = f"accepted {sorted(normed.norms)}"
                    del normed
                except UpdateRejected as exc:
                    verdict = str(exc.reason)
                return got.finite, verdict
        finally:
            a.close()
            b.close()

    finite, verdict = asyncio.run(scenario())
    assert finite is not None
    if poison:
        assert finite.bad == "g_wide" and verdict == Reject.NON_FINITE
    else:
        assert finite.bad is None
        assert verdict == "accepted ['a_big', 'b_half', 'c_bf16', 'f_scalar', 'g_wide']"
