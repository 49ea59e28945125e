"""Segment digests on real transfers (fedgpu/core/segments.py, issue 37 point 1): a real
aggregator with its bulk port, the node's real bulk and gRPC clients, and the fault-injecting
proxy (tests/net/fault_proxy.py) cutting a transfer in the middle of a segment.

A cut resumes from the start of the segment it fell in (the end of the last verified one),
never from bytes nobody has checked: the bytes sent twice are the cut segment's head, within
issue 37's 5% of the payload. A damaged segment is refused naming it and nothing is folded; a
header announcing the wrong number of digests, or digests that do not hash to its payload
digest (BLAKE3_SEGMENTS, the wire's), is refused before any byte is sent; an older sender's
plain BLAKE3 payload with segment digests is still taken, checked in two passes.

Threat model: bytes damaged or spliced on the way (a middlebox, a proxy, a resumed stream
continued with other bytes) are refused at the first segment they touch; the whole-payload
digest is checked as well (tests/integration/test_resume.py). A hostile header cannot make the
aggregator take more digests than its payload has segments.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from fedgpu.core import bulk, codec, digests, segment_hasher, segments
from fedgpu.core.segments import segment_bytes
from fedgpu.node.bulk_client import BulkPath
from fedgpu.node.pulled import default_receiver
from fedgpu.node.wire_client import WireClient
from fedgpu.proto import pb
from tests.fixtures.bulk_wire import Wire, served
from tests.fixtures.federation import job_dir
from tests.integration.test_resume import (
    FRAMING,
    GRPC_FRAMING,
    GRPC_WINDOW,
    RESEND_SHARE,
    grpc_pull,
)
from tests.integration.test_resume import _finished as finished
from tests.net.fault_proxy import READ, FaultProxy, Way

pytestmark = pytest.mark.timeout(120)

# 21 MiB: 43 segments of 512 KiB, so a cut in the middle of one re-sends under 5% of it.
MODEL = {"w": np.arange(21 << 18, dtype=np.float32) / (1 << 20)}
SEG = segment_bytes(codec.encode(MODEL, digest=None).size)
SEGMENTS = 43
# Where the cuts fall: half way into segment 10.
CUT = 10 * SEG + SEG // 2
# The proxy counts what it read from the sender, up to one read past the cut.
SLACK = FRAMING + READ


@pytest.fixture(scope="module", name="wire")
def wire_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    # A refused update ends its attempt: retries keep the job open for the next test.
    with served(tmp_path_factory.mktemp("segments"), MODEL, "--upload-idle-s", "60",
                "--chunk-size", str(64 << 10), rounds=40, round_retries=10,
                node_name="site") as wire:
        yield wire


def _update(task: pb.TaskHeader, scale: float) -> tuple[codec.Encoded, bytes, bytes]:
    enc = codec.encode({"w": MODEL["w"] * scale + task.round})
    return enc, enc.segment_digests, enc.to_bytes()


def _header(wire: Wire, task: pb.TaskHeader, enc: codec.Encoded, segs: bytes
            ) -> pb.UpdateHeader:
    header = wire.header(task, enc)
    header.payload_segment_digests = segs
    return header


def _bulk_path(wire: Wire) -> BulkPath:
    path = BulkPath(f"127.0.0.1:{wire.bulk_port}", None)
    path.reset(wire.bulk_port)
    return path


def test_the_task_header_announces_its_payload_s_segments(wire: Wire) -> None:
    task = wire.task()
    assert len(task.payload_segment_digests) == 32 * segments.count(task.payload_size)
    assert segments.count(task.payload_size) == SEGMENTS and SEG == 512 << 10


def test_a_bulk_upload_cut_mid_segment_resumes_from_that_segment_s_start(wire: Wire) -> None:
    task = wire.task()
    enc, digests, _ = _update(task, 2.0)
    ticket = wire.stub.OpenUpload(_header(wire, task, enc, digests), metadata=wire.md,
                                  timeout=10)
    path = _bulk_path(wire)
    with FaultProxy(("127.0.0.1", wire.bulk_port)) as proxy:
        # SENDER_RESET: the aggregator gets every byte up to the cut, hello included.
        proxy.cut(Way.UP, CUT)
        message = path.upload(ticket.ticket, proxy.port, enc.segments)
        carried = proxy.carried[Way.UP]
    assert "accepted" in message and path.resumed == 1
    resent = carried - enc.size
    # The head of segment 10 crossed twice (not only the bytes in flight): the aggregator
    # kept segments 0-9, the ones it had verified.
    assert SEG // 2 - FRAMING <= resent <= SEG // 2 + SLACK, resent
    assert resent <= RESEND_SHARE * enc.size
    rec = finished(wire, task.round)
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1 and not rec["rejected"]
    model = codec.read_file(job_dir(wire.state_dir) / "global.safetensors")
    assert np.array_equal(model["w"], codec.decode(enc.to_bytes())[0]["w"])


def test_a_bulk_download_cut_mid_segment_resumes_from_that_segment_s_start(wire: Wire) -> None:
    task = wire.task()
    asm = default_receiver(task, 1 << 30)
    path = _bulk_path(wire)
    with FaultProxy(("127.0.0.1", wire.bulk_port)) as proxy:
        proxy.cut(Way.DOWN, CUT)
        path.download(task.bulk.ticket, proxy.port, asm)
        carried = proxy.carried[Way.DOWN]
    asm.finish()  # every segment and the whole payload checked
    asm.release()
    assert path.resumed == 1 and proxy.connections == 2
    resent = carried - task.payload_size
    assert SEG // 2 - FRAMING <= resent <= SEG // 2 + SLACK, resent
    assert resent <= RESEND_SHARE * task.payload_size
    enc, digests, _ = _update(task, 2.5)
    ticket = wire.stub.OpenUpload(_header(wire, task, enc, digests), metadata=wire.md,
                                  timeout=10)
    assert bulk.upload("127.0.0.1", wire.bulk_port, None, ticket.ticket, enc.segments).ok
    rec = finished(wire, task.round)
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1


def test_a_grpc_upload_resumes_from_a_verified_segment(wire: Wire) -> None:
    """UploadOffset answers the end of the last verified segment, never bytes unchecked."""
    task = wire.task()
    enc, digests, _ = _update(task, 3.0)
    header = _header(wire, task, enc, digests)
    host, port = wire.fed.address.rsplit(":", 1)

    async def push(proxy: FaultProxy) -> tuple[pb.PushReply, str, int]:
        client = WireClient(f"127.0.0.1:{proxy.port}", wire.fed.token)
        try:
            client.chunk_size = 64 << 10
            reply, way = await client.push(header, enc)
            return reply, way, client.resumed
        finally:
            await client.close()

    with FaultProxy((host, int(port))) as proxy:
        proxy.cut(Way.UP, CUT + GRPC_FRAMING)
        reply, way, resumed = asyncio.run(push(proxy))
        carried = proxy.carried[Way.UP]
    assert reply.accepted and way == "grpc" and resumed == 1, reply
    assert 0 < header.payload_offset < enc.size
    assert header.payload_offset % SEG == 0, header.payload_offset
    assert carried - enc.size - 2 * GRPC_FRAMING <= GRPC_WINDOW + SEG
    rec = finished(wire, task.round)
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1


def test_a_grpc_task_stream_resumes_from_a_verified_segment(wire: Wire) -> None:
    wire.task()  # the round's task is open
    host, port = wire.fed.address.rsplit(":", 1)

    with FaultProxy((host, int(port))) as proxy:
        proxy.cut(Way.DOWN, CUT + GRPC_FRAMING)
        header, resumed = asyncio.run(grpc_pull(wire, proxy, 64 << 10))
    assert resumed == 1 and proxy.connections == 2
    # gRPC may drop messages it had read but not handed over at the break (GRPC_WINDOW):
    # wherever the node's bytes ended, it asks from the end of a verified segment.
    assert 0 < header.payload_offset <= 10 * SEG, header.payload_offset
    assert header.payload_offset % SEG == 0, header.payload_offset
    enc, digests, _ = _update(header, 3.5)
    ticket = wire.stub.OpenUpload(_header(wire, header, enc, digests), metadata=wire.md,
                                  timeout=10)
    assert bulk.upload("127.0.0.1", wire.bulk_port, None, ticket.ticket, enc.segments).ok
    rec = finished(wire, header.round)
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1


@pytest.mark.parametrize("announced", [1, SEGMENTS + 1])
def test_a_header_with_the_wrong_digest_count_is_refused(wire: Wire, announced: int) -> None:
    task = wire.task()
    enc, digests, _ = _update(task, 4.0)
    extra = b"\0" * 32 * (announced > SEGMENTS)
    header = _header(wire, task, enc, digests[: 32 * announced] + extra)
    with pytest.raises(grpc.RpcError) as err:
        wire.stub.OpenUpload(header, metadata=wire.md, timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"has {SEGMENTS} segments" in err.value.details()


def test_a_damaged_segment_on_grpc_is_refused_naming_it(wire: Wire) -> None:
    """The same check on the gRPC fallback (PushUpdate): chunks fold into the same segment
    checks as a bulk connection's reads."""
    task = wire.task()
    before = codec.read_file(job_dir(wire.state_dir) / "global.safetensors")["w"].copy()
    enc, digests, data = _update(task, 4.5)
    bad = bytearray(data)
    bad[3 * SEG + 5] ^= 0x01

    def stream() -> Iterator[pb.UpdateChunk]:
        yield pb.UpdateChunk(header=_header(wire, task, enc, digests))
        for pos in range(0, len(bad), 1 << 20):
            yield pb.UpdateChunk(data=bytes(bad[pos:pos + (1 << 20)]))

    with pytest.raises(grpc.RpcError) as err:
        wire.stub.PushUpdate(stream(), metadata=wire.md, timeout=30)
    assert f"segment 3 of {SEGMENTS}" in err.value.details(), err.value.details()
    now = codec.read_file(job_dir(wire.state_dir) / "global.safetensors")["w"]
    assert np.array_equal(now, before)


def test_a_damaged_segment_is_refused_naming_it_and_nothing_is_folded(wire: Wire) -> None:
    """A hostile sender (or a proxy flipping a byte): the announced digests are the true
    payload's, one byte of segment 7 is not."""
    task = wire.task()
    before = codec.read_file(job_dir(wire.state_dir) / "global.safetensors")["w"].copy()
    enc, digests, data = _update(task, 5.0)
    ticket = wire.stub.OpenUpload(_header(wire, task, enc, digests), metadata=wire.md,
                                  timeout=10)
    bad = bytearray(data)
    bad[7 * SEG + 1234] ^= 0x40
    with wire.connect() as s:
        s.settimeout(30)
        bulk.send_ticket(s, ticket.ticket)
        assert bulk.read_status(s).ok
        # The aggregator stops reading at the damaged segment: the rest may not all go out.
        try:
            s.sendall(bad)
        except OSError:
            pass
        verdict = bulk.read_status(s)
    assert not verdict.ok and verdict.reason == "digest", verdict
    assert f"segment 7 of {SEGMENTS}" in verdict.message
    now = codec.read_file(job_dir(wire.state_dir) / "global.safetensors")["w"]
    assert np.array_equal(now, before)


def test_a_header_whose_segments_do_not_hash_to_its_digest_is_refused(wire: Wire) -> None:
    """Every digest is a true segment's, but two are swapped: the list is not the one the
    payload digest names, and the aggregator refuses the header before a byte moves."""
    task = wire.task()
    enc, segs, _ = _update(task, 6.0)
    swapped = segs[32:64] + segs[:32] + segs[64:]
    with pytest.raises(grpc.RpcError) as err:
        wire.stub.OpenUpload(_header(wire, task, enc, swapped), metadata=wire.md, timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "segment digests hash to" in err.value.details(), err.value.details()


def test_an_older_sender_s_plain_blake3_update_is_still_taken(wire: Wire) -> None:
    """A node of the version before: "blake3" names the whole payload's plain BLAKE3, and
    its segment digests come from a second pass; the aggregator checks both."""
    task = wire.task()
    enc = codec.encode({"w": MODEL["w"] * 6.5 + task.round}, digest=codec.DigestAlgo.BLAKE3)
    assert not enc.segment_digests
    _, segs = segment_hasher.of_views(enc.segments)
    header = wire.header(task, enc)
    digests.stamp(header, codec.DigestAlgo.BLAKE3, enc.digest)
    header.payload_segment_digests = segs
    ticket = wire.stub.OpenUpload(header, metadata=wire.md, timeout=10)
    assert bulk.upload("127.0.0.1", wire.bulk_port, None, ticket.ticket, enc.segments).ok
    rec = finished(wire, task.round)  # (its attempt counts the refusals of the tests before)
    assert len(rec["updates"]) == 1
    model = codec.read_file(job_dir(wire.state_dir) / "global.safetensors")
    assert np.array_equal(model["w"], codec.decode(enc.to_bytes())[0]["w"])
