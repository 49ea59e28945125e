"""Transfers that resume (issue 37): a real aggregator with its bulk port, the node's real bulk
client (node/bulk_client.py), and a fault-injecting proxy (tests/net/fault_proxy.py) that cuts
a download or an upload at 30, 60 or 90% of its payload.

Each cut asserts what a site over a broken link needs: the transfer completes on the same
ticket, no more than 5% of the payload crosses twice, the update is counted once in an attempt
that needed no retry, and the site's own retry is never refused as a duplicate of itself.

Threat model checked here: a resumed payload is verified by the digest its header names
before it is used (a resume cannot splice in other bytes unnoticed), and a resume ticket is
the same one-time secret the gRPC call handed to the authenticated node, bound to that node,
task, direction and payload (tests/unit/test_bulk_wire.py: expiry, certificate binding).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core import bulk, codec
from fedgpu.core.segments import segment_bytes
from fedgpu.node.bulk_client import BulkPath
from fedgpu.node.wire_client import GRPC_RESUMES, WireClient
from fedgpu.proto import pb
from tests.fixtures.bulk_wire import Wire, served, wait_for
from tests.fixtures.federation import job_dir
from tests.net.fault_proxy import FaultProxy, Way

pytestmark = pytest.mark.timeout(120)

# A 4 MiB model: big enough that a cut lands mid-stream, small enough to stay fast.
MODEL = {"w": np.arange(1 << 20, dtype=np.float32) / (1 << 20)}
# Bytes re-sent beyond the payload, at most (issue 37's target).
RESEND_SHARE = 0.05
# Status frames and hellos ride beside the payload: a few hundred bytes per connection.
FRAMING = 1024
# gRPC chunks: a break loses the chunk in flight, so a 4 MiB test payload needs small ones to
# show the 5% target (a 1 MiB default chunk is under 5% of a payload of 20 MiB or more).
GRPC_CHUNK = 64 << 10
# HTTP/2 framing and the task header on a gRPC stream.
GRPC_FRAMING = 16 << 10
# On gRPC a break also loses the messages HTTP/2 had taken in but not handed over yet (within
# its flow-control windows: 0.5-2.2 MB measured on loopback, where the transport reads far
# ahead of the Python loop). That is over 5% of this 4 MiB payload, and the 5% target on gRPC
# holds only for payloads of ~80 MB and more. The bulk path, which hands every byte straight
# to the payload's buffer, loses none.
GRPC_WINDOW = 4 << 20


@pytest.fixture(scope="module", name="wire")
def wire_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    # A long idle limit: a stuck connection must not end by itself during a test.
    with served(tmp_path_factory.mktemp("resume"), MODEL, "--upload-idle-s", "60",
                "--chunk-size", str(GRPC_CHUNK), rounds=40, round_retries=5,
                node_name="site") as wire:
        yield wire


async def grpc_pull(wire: Wire, proxy: FaultProxy, chunk_size: int | None = None
                    ) -> tuple[pb.TaskHeader, int]:
    """The node's client pulls its task through `proxy` (the weights over gRPC): the task's
    header and how many times the client resumed."""
    client = WireClient(f"127.0.0.1:{proxy.port}", wire.fed.token)
    try:
        if chunk_size is not None:
            client.chunk_size = chunk_size
        pulled = await client.pull(wire.node_id, 0, 1 << 30)
        assert pulled.payload is not None and pulled.transport == "grpc"
        assert pulled.receiver is not None
        pulled.receiver.release()  # type: ignore[union-attr]
        return pulled.header, client.resumed
    finally:
        await client.close()


def _round_of(wire: Wire, number: int) -> dict:  # type: ignore[type-arg]
    rounds = wire.fed.query("ListRounds")["rounds"]
    done = [r for r in rounds if r["round"] == number and r["status"] == "finished"]
    assert done, f"round {number} did not finish: {rounds[-1:]}"
    return done[-1]


def _finished(wire: Wire, number: int) -> dict:  # type: ignore[type-arg]
    wait_for(lambda: any(r["round"] == number and r["status"] == "finished"
                         for r in wire.fed.query("ListRounds")["rounds"]),
             timeout=30, what=f"round {number} finished")
    # The record is listed before the round's model is committed (the checkpoint follows it):
    # a test that reads global.safetensors waits for the commit too.
    wait_for(lambda: wire.fed.query("ListJobs")[0]["rounds_done"] >= number, timeout=30,
             what=f"round {number} committed")
    return _round_of(wire, number)


def _update(task: pb.TaskHeader, scale: float) -> codec.Encoded:
    return codec.encode({"w": MODEL["w"] * scale + task.round})


@pytest.mark.parametrize("share", [0.3, 0.6, 0.9])
def test_a_download_cut_resumes_from_the_bytes_held(wire: Wire, share: float) -> None:
    task = wire.task()
    path = BulkPath(f"127.0.0.1:{wire.bulk_port}", None)
    path.reset(wire.bulk_port)
    asm = codec.Assembler(task.payload_size, task.payload_digest, 1 << 30,
                          codec.WIRE_DIGEST)
    with FaultProxy(("127.0.0.1", wire.bulk_port)) as proxy:
        proxy.cut(Way.DOWN, int(task.payload_size * share))
        path.download(task.bulk.ticket, proxy.port, asm)
        carried = proxy.carried[Way.DOWN]
    payload = asm.finish()  # the whole payload, checked against the header's BLAKE3
    assert codec.decode(payload)[0]["w"].shape == MODEL["w"].shape
    asm.release()
    assert path.resumed == 1 and proxy.connections == 2
    resent = carried - task.payload_size - FRAMING
    assert resent <= RESEND_SHARE * task.payload_size, (carried, task.payload_size)
    # The round goes on with this download: one update, one attempt.
    enc = _update(task, 2.0)
    ticket = wire.stub.OpenUpload(wire.header(task, enc), metadata=wire.md, timeout=10)
    assert bulk.upload("127.0.0.1", wire.bulk_port, None, ticket.ticket, enc.segments).ok
    rec = _finished(wire, task.round)
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1


@pytest.mark.parametrize("share", [0.3, 0.6, 0.9])
def test_a_grpc_task_stream_cut_resumes_from_the_bytes_held(wire: Wire, share: float) -> None:
    """The gRPC fallback: the node's wire client asks for the rest of the task's payload
    (PullTaskRequest.resume_offset) on a new stream after its connection was cut."""
    wire.task()  # the round's task is open
    host, port = wire.fed.address.rsplit(":", 1)

    async def pull(proxy: FaultProxy) -> tuple[pb.TaskHeader, bytes, int]:
        client = WireClient(f"127.0.0.1:{proxy.port}", wire.fed.token)
        try:
            client.chunk_size = GRPC_CHUNK
            pulled = await client.pull(wire.node_id, 0, 1 << 30)
            assert pulled.payload is not None and pulled.transport == "grpc"
            data = bytes(pulled.payload)
            assert pulled.receiver is not None
            pulled.receiver.release()  # type: ignore[union-attr]
            return pulled.header, data, client.resumed
        finally:
            await client.close()

    with FaultProxy((host, int(port))) as proxy:
        # The cut counts from the connection's first byte: HTTP/2 set-up and the header first.
        proxy.cut(Way.DOWN, int(4 * (1 << 20) * share) + GRPC_FRAMING)
        header, data, resumed = asyncio.run(pull(proxy))
        carried = proxy.carried[Way.DOWN]
    # One resume after the cut, which goes at once; rarely (1 in ~10 here) that first resume
    # still meets the channel's dead transport and fails before its header, moving nothing, and a
    # second follows after the backoff (node/resume_backoff.py): the bytes below are what count.
    assert 1 <= resumed <= 2 and 2 <= proxy.connections <= 3, (resumed, proxy.connections)
    assert codec.decode(memoryview(bytearray(data)))[0]["w"].shape == MODEL["w"].shape
    resent = carried - header.payload_size - proxy.connections * GRPC_FRAMING
    # The task announces segment digests: the node resumes from the end of its last verified
    # segment (0 when the bytes it got end inside the first), re-sending at most one segment
    # beyond what the break lost (tests/integration/test_resume_segments.py).
    assert resent <= GRPC_WINDOW + segment_bytes(header.payload_size), carried
    assert 0 <= header.payload_offset < header.payload_size  # never past what it verified
    assert header.payload_offset % segment_bytes(header.payload_size) == 0
    # The round goes on: one update, one attempt.
    enc = _update(header, 2.5)
    ticket = wire.stub.OpenUpload(wire.header(header, enc), metadata=wire.md, timeout=10)
    assert bulk.upload("127.0.0.1", wire.bulk_port, None, ticket.ticket, enc.segments).ok
    rec = _finished(wire, header.round)
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1


def test_a_grpc_resume_that_finds_no_server_keeps_the_bytes_held(wire: Wire) -> None:
    """The first resume after a cut goes at once (node/resume_backoff.py: no pause after a
    stream that moved bytes). When that resume breaks too before its header comes (the link
    still down), the bytes held are kept and the next resume, after a pause, continues from
    them: the payload is not asked for from byte 0."""
    wire.task()
    host, port = wire.fed.address.rsplit(":", 1)

    with FaultProxy((host, int(port))) as proxy:
        proxy.cut(Way.DOWN, (2 << 20) + GRPC_FRAMING)
        # The resume's connection is closed after the aggregator's first byte (its HTTP/2
        # set-up not whole). (A reset of the node's end here would wait for the proxy's other
        # thread, blocked reading from the node, and look like a link gone silent: the
        # connect then fails only after gRPC's 20 s connect timeout.)
        proxy.cut(Way.DOWN, 1, connection=1)
        header, resumed = asyncio.run(grpc_pull(wire, proxy))
    # Two resumes at least: the one that found no server, and one (or, when it came inside
    # gRPC's own reconnect backoff and failed at once, a later one) that got the rest.
    assert 2 <= resumed <= GRPC_RESUMES and proxy.connections == 3, (resumed,
                                                                     proxy.connections)
    assert 0 < header.payload_offset < header.payload_size  # the rest, not a second copy
    enc = _update(header, 1.5)
    ticket = wire.stub.OpenUpload(wire.header(header, enc), metadata=wire.md, timeout=10)
    assert bulk.upload("127.0.0.1", wire.bulk_port, None, ticket.ticket, enc.segments).ok
    rec = _finished(wire, header.round)
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1


@pytest.mark.parametrize("share", [0.3, 0.6, 0.9])
def test_an_upload_cut_resumes_and_is_counted_once(wire: Wire, share: float) -> None:
    task = wire.task()
    enc = _update(task, 3.0)
    ticket = wire.stub.OpenUpload(wire.header(task, enc), metadata=wire.md, timeout=10)
    path = BulkPath(f"127.0.0.1:{wire.bulk_port}", None)
    path.reset(wire.bulk_port)
    with FaultProxy(("127.0.0.1", wire.bulk_port)) as proxy:
        proxy.cut(Way.UP, int(enc.size * share))
        message = path.upload(ticket.ticket, proxy.port, enc.segments)
        carried = proxy.carried[Way.UP]
    assert "accepted" in message and path.resumed == 1
    resent = carried - enc.size - FRAMING
    assert resent <= RESEND_SHARE * enc.size, (carried, enc.size)
    rec = _finished(wire, task.round)
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1
    assert rec["bytes_received"] == enc.size and not rec["rejected"]
    model = codec.read_file(job_dir(wire.state_dir) / "global.safetensors")
    assert np.array_equal(model["w"], codec.decode(enc.to_bytes())[0]["w"])
    # The retry of an accepted update (its acknowledgement lost) is acknowledged, not counted.
    again = wire.stub.OpenUpload(wire.header(task, enc), metadata=wire.md, timeout=10)
    assert again.already_accepted and "accepted" in again.message
    assert len(_round_of(wire, task.round)["updates"]) == 1


@pytest.mark.parametrize("share", [0.3, 0.6, 0.9])
def test_a_grpc_upload_cut_resumes_and_is_counted_once(wire: Wire, share: float) -> None:
    """The gRPC fallback upload: the node's wire client asks where to resume (UploadOffset)
    and streams the rest after its connection was cut."""
    task = wire.task()
    enc = _update(task, 3.5)
    header = wire.header(task, enc)
    host, port = wire.fed.address.rsplit(":", 1)

    async def push(proxy: FaultProxy) -> tuple[pb.PushReply, str, int]:
        client = WireClient(f"127.0.0.1:{proxy.port}", wire.fed.token)
        try:
            client.chunk_size = GRPC_CHUNK
            reply, path = await client.push(header, enc)
            return reply, path, client.resumed
        finally:
            await client.close()

    with FaultProxy((host, int(port))) as proxy:
        proxy.cut(Way.UP, int(enc.size * share) + GRPC_FRAMING)
        reply, path, resumed = asyncio.run(push(proxy))
        carried = proxy.carried[Way.UP]
    assert reply.accepted and path == "grpc" and resumed == 1, reply
    # The node announced segment digests: the aggregator kept its verified segments only (none
    # when the bytes it got end inside the first), at most one segment more to send again.
    assert 0 <= header.payload_offset < enc.size  # never past what it verified
    assert header.payload_offset % segment_bytes(enc.size) == 0
    resent = carried - enc.size - 2 * GRPC_FRAMING
    assert resent <= GRPC_WINDOW + segment_bytes(enc.size), (carried, enc.size)
    rec = _finished(wire, task.round)
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1
    # The cut stream is listed as truncated; it did not end the node's part in the round.
    assert {r["reason"] for r in rec["rejected"]} <= {"truncated"}
    assert rec["updates"][0]["transport"] == "grpc"


def _stuck_upload(wire: Wire, ticket: str, data: bytes, share: float) -> socket.socket:
    """An upload whose sender vanished without the aggregator noticing: part of the payload
    sent, then silence on a connection that stays open (a reset that never arrived)."""
    s = wire.connect()
    s.settimeout(30)
    bulk.send_ticket(s, ticket)
    assert bulk.read_status(s).ok
    s.sendall(data[: int(len(data) * share)])
    wait_for(lambda: wire.status()["uploads"]["in_flight"] == 1, timeout=10,
             what="the upload in flight")
    return s


def test_a_broken_upload_s_own_retry_on_its_ticket_takes_over(wire: Wire) -> None:
    """Issue 37's broken upload slot: the site's socket was reset, the aggregator still holds
    the slot as uploading; the site's retry resumes at once instead of being refused as a
    duplicate until the 60 s idle limit."""
    task = wire.task()
    enc = _update(task, 4.0)
    ticket = wire.stub.OpenUpload(wire.header(task, enc), metadata=wire.md, timeout=10)
    stuck = _stuck_upload(wire, ticket.ticket, enc.to_bytes(), 0.5)
    try:
        started = time.monotonic()
        path = BulkPath(f"127.0.0.1:{wire.bulk_port}", None)
        path.reset(wire.bulk_port)
        assert "accepted" in path.upload(ticket.ticket, wire.bulk_port, enc.segments)
        assert time.monotonic() - started < 15
    finally:
        stuck.close()
    rec = _finished(wire, task.round)
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1 and not rec["rejected"]
    assert wire.status()["bulk"]["resumed"] >= 1


def test_a_broken_upload_s_retry_on_a_new_ticket_is_not_a_duplicate(wire: Wire) -> None:
    """The same, when the site's retry asks for a new ticket (its resume ticket expired, or
    it lost it): the older stream of its own is ended and the retry accepted."""
    task = wire.task()
    enc = _update(task, 5.0)
    first = wire.stub.OpenUpload(wire.header(task, enc), metadata=wire.md, timeout=10)
    stuck = _stuck_upload(wire, first.ticket, enc.to_bytes(), 0.3)
    try:
        retry = wire.stub.OpenUpload(wire.header(task, enc), metadata=wire.md, timeout=15)
        assert retry.ticket and not retry.already_accepted
        assert bulk.upload("127.0.0.1", wire.bulk_port, None, retry.ticket, enc.segments).ok
    finally:
        stuck.close()
    rec = _finished(wire, task.round)
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1 and not rec["rejected"]


def test_a_resumed_upload_with_other_bytes_is_refused_by_its_digest(wire: Wire) -> None:
    """Resuming cannot splice bytes: a second half that is not the announced payload's fails
    the whole-payload digest, and the model is unchanged."""
    task = wire.task()
    before = codec.read_file(job_dir(wire.state_dir) / "global.safetensors")["w"].copy()
    enc = _update(task, 6.0)
    ticket = wire.stub.OpenUpload(wire.header(task, enc), metadata=wire.md, timeout=10)
    data = enc.to_bytes()
    half = len(data) // 2
    parked = wire.status()["uploads"]["parked_for_resume"]
    with wire.connect() as s:
        s.settimeout(30)
        bulk.send_ticket(s, ticket.ticket)
        assert bulk.read_status(s).ok
        s.sendall(data[:half])
        s.shutdown(socket.SHUT_WR)
    wait_for(lambda: wire.status()["uploads"]["parked_for_resume"] == parked + 1, timeout=10,
             what="parked")
    other = _update(task, 7.0).to_bytes()
    with wire.connect() as s:
        s.settimeout(30)
        bulk.send_ticket(s, ticket.ticket)
        go = bulk.read_status(s)
        assert go.ok and go.offset == half
        s.sendall(other[half:])
        verdict = bulk.read_status(s)
    assert not verdict.ok and verdict.reason == "digest"
    now = codec.read_file(job_dir(wire.state_dir) / "global.safetensors")["w"]
    assert np.array_equal(now, before)


def test_parked_bytes_count_against_the_budget_and_expire(tmp_path: Path) -> None:
    """Parked uploads hold their reservation of upload memory, and let it go when their
    resume time runs out (server/transfer/uploads.py, with a short resume time)."""
    import asyncio

    from fedgpu.server.transfer.uploads import Uploads

    enc = codec.encode(MODEL)

    async def scenario() -> tuple[int, int, int, int]:
        uploads = Uploads(1 << 30, budget_bytes=64 << 20, idle_s=5, resume_ttl_s=0.3)
        a, b = socket.socketpair()
        a.settimeout(5)
        header = pb.UpdateHeader(payload_size=enc.size)
        from fedgpu.core import digests
        digests.stamp(header, codec.WIRE_DIGEST, enc.digest)
        data = enc.to_bytes()

        async def blocking(fn, *args):  # type: ignore[no-untyped-def]
            return await asyncio.to_thread(fn, *args)

        async def send_half() -> None:
            await asyncio.to_thread(bulk.read_status, a)
            await asyncio.to_thread(a.sendall, data[: len(data) // 2])
            a.shutdown(socket.SHUT_WR)

        sender = asyncio.create_task(send_half())
        with pytest.raises(ConnectionError):
            async with uploads.receive_socket("n", header, b, time.time() + 10, blocking,
                                              "ticket-1"):
                pass
        await sender
        stats = uploads.stats()
        held, parked = stats["memory_reserved_bytes"], stats["parked_for_resume"]
        await asyncio.sleep(0.6)
        stats = uploads.stats()
        a.close()
        b.close()
        return held, parked, stats["memory_reserved_bytes"], stats["expired_unresumed"]

    held, parked, after, expired = asyncio.run(scenario())
    assert parked == 1 and held == enc.size
    assert after == 0 and expired == 1
