"""The bulk path's pieces without a server: tickets, the conversation's frames over a real
socket pair, payloads from a checkpoint file, and the receive loop's limits."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core import bulk, codec
from fedgpu.core.buffers import BufferPool
from fedgpu.core.digest_sink import DigestSink
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.server.transfer.payload import ModelPayload, to_wire, wire_spec
from fedgpu.server.transfer.tickets import TicketBook, TicketRefused


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_ticket_is_spent_once_and_expires() -> None:
    clock = Clock()
    book = TicketBook(ttl_s=30, clock=clock)
    t = book.issue(bulk.Direction.DOWNLOAD, "n1", "site-a", "task", 100)
    assert book.redeem(t.token, None).task_id == "task"
    book.finished(t.token)
    with pytest.raises(TicketRefused, match="already used") as used:
        book.redeem(t.token, None)
    assert used.value.reason == "used"
    late = book.issue(bulk.Direction.UPLOAD, "n1", "site-a", "task", 100)
    clock.now += 31
    with pytest.raises(TicketRefused, match="expired") as expired:
        book.redeem(late.token, None)
    assert expired.value.reason == "expired"
    with pytest.raises(TicketRefused, match="not one this aggregator issued") as forged:
        book.redeem("x" * 43, None)
    assert forged.value.reason == "unknown"
    assert dict(book.refused) == {"used": 1, "expired": 1, "unknown": 1}
    assert book.outstanding == 0


def test_a_broken_transfer_s_ticket_resumes_for_a_bounded_time() -> None:
    """The resume ticket: presented again after its connection broke, within RESUME_TTL_S of
    the break, it names the same transfer; past that it is expired, after a verdict spent."""
    clock = Clock()
    book = TicketBook(ttl_s=30, resume_ttl_s=120, clock=clock)
    t = book.issue(bulk.Direction.UPLOAD, "n1", "site-a", "task", 100)
    first = book.redeem(t.token, None)
    clock.now += 100
    book.broke(t.token)
    clock.now += 119
    again = book.redeem(t.token, None)
    assert again is first and book.resumable == 1
    book.broke(t.token)
    clock.now += 121
    with pytest.raises(TicketRefused, match="expired"):
        book.redeem(t.token, None)
    done = book.issue(bulk.Direction.UPLOAD, "n1", "site-a", "task", 100)
    book.redeem(done.token, None)
    book.finished(done.token)
    with pytest.raises(TicketRefused, match="already used"):
        book.redeem(done.token, None)
    assert book.resumable == 0


def test_a_resume_ticket_is_still_bound_to_its_node_certificate() -> None:
    book = TicketBook()
    t = book.issue(bulk.Direction.DOWNLOAD, "n1", "site-a", "task", 1)
    book.redeem(t.token, frozenset({"site-a"}))
    book.broke(t.token)
    with pytest.raises(TicketRefused, match="certificate for site-b"):
        book.redeem(t.token, frozenset({"site-b"}))


def test_under_mutual_tls_a_ticket_binds_its_node_certificate() -> None:
    book = TicketBook()
    t = book.issue(bulk.Direction.DOWNLOAD, "n1", "site-a", "task", 1)
    with pytest.raises(TicketRefused, match="certificate for site-b") as err:
        book.redeem(t.token, frozenset({"site-b"}))
    assert err.value.reason == "wrong_peer"
    # Spent by the attempt: the rightful owner asks for a new one.
    with pytest.raises(TicketRefused, match="already used"):
        book.redeem(t.token, frozenset({"site-a"}))
    ok = book.issue(bulk.Direction.DOWNLOAD, "n1", "site-a", "task", 1)
    assert book.redeem(ok.token, frozenset({"site-a", "10.0.0.5"})).node_name == "site-a"


def test_tokens_are_unguessable_and_distinct() -> None:
    book = TicketBook()
    tokens = {book.issue(bulk.Direction.UPLOAD, "n", "n", str(i), 1).token for i in range(500)}
    assert len(tokens) == 500 and all(len(t) >= 40 for t in tokens)


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    return a, b


def test_ticket_and_status_frames_round_trip_and_bad_ones_are_refused() -> None:
    a, b = _pair()
    with a, b:
        bulk.send_ticket(a, "abc")
        assert bulk.read_ticket(b) == "abc"
        bulk.write_status(b, bulk.Status(False, "PERMISSION_DENIED", "used", "no"))
        assert bulk.read_status(a) == bulk.Status(False, "PERMISSION_DENIED", "used", "no")
        a.sendall(b"HTTP/1.1")
        with pytest.raises(bulk.BulkProtocolError, match="bad magic"):
            bulk.read_ticket(b)
    a, b = _pair()
    with a, b:
        a.sendall(bulk.MAGIC + (60000).to_bytes(2, "big"))
        with pytest.raises(bulk.BulkProtocolError, match="at most"):
            bulk.read_ticket(b)
        b.sendall((1 << 30).to_bytes(4, "big"))
        with pytest.raises(bulk.BulkProtocolError, match="status frame"):
            bulk.read_status(a)


@pytest.mark.parametrize("pooled", [False, True])
def test_a_payload_lands_in_the_buffer_with_its_digest(pooled: bool) -> None:
    enc = codec.encode({"w": np.arange(300_000, dtype=np.float32)})
    pool = BufferPool(1 << 30) if pooled else None
    for _ in range(2):
        a, b = _pair()
        with a, b:
            sender = threading.Thread(target=bulk.send_payload, args=(a, enc.segments))
            sender.start()
            asm = codec.Assembler(enc.size, enc.digest, 1 << 30, enc.algorithm, pool)
            seen: list[int] = []
            bulk.recv_payload(b, asm, idle_s=10, on_bytes=seen.append)
            sender.join()
            got, _ = codec.decode(asm.finish())
            assert np.array_equal(got["w"], np.arange(300_000)) and sum(seen) == enc.size
            asm.release()
    if pool is not None:
        assert pool.held == enc.size  # one buffer, warm for the next payload


def test_the_receive_loop_ends_on_early_close_and_on_silence() -> None:
    enc = codec.encode({"w": np.ones(1000, np.float32)})
    a, b = _pair()
    with a, b:
        a.sendall(enc.to_bytes()[:100])
        a.shutdown(socket.SHUT_WR)
        asm = codec.Assembler(enc.size, enc.digest, 1 << 20, enc.algorithm)
        with pytest.raises(codec.Truncated, match="got 100 of"):
            bulk.recv_payload(b, asm, idle_s=5)
    a, b = _pair()
    with a, b:
        asm = codec.Assembler(enc.size, enc.digest, 1 << 20, enc.algorithm)
        with pytest.raises(TimeoutError):
            bulk.recv_payload(b, asm, idle_s=0.2)


def test_a_trickling_sender_is_cut_off_at_the_minimum_rate() -> None:
    """One byte every 0.1 s never trips the idle timeout (issue 24): the average rate does."""
    enc = codec.encode({"w": np.ones(1000, np.float32)})
    data = enc.to_bytes()
    a, b = _pair()
    stop = threading.Event()

    def trickle() -> None:
        for i in range(len(data)):
            if stop.wait(0.1):
                return
            try:
                a.sendall(data[i:i + 1])
            except OSError:
                return

    sender = threading.Thread(target=trickle, daemon=True)
    with a, b:
        sender.start()
        asm = codec.Assembler(enc.size, enc.digest, 1 << 20, enc.algorithm)
        started = time.monotonic()
        try:
            with pytest.raises(bulk.TooSlow, match="fell below 1000 bytes/s"):
                bulk.recv_payload(b, asm, idle_s=5, min_rate=1000, grace_s=0.5)
        finally:
            stop.set()
        assert time.monotonic() - started < 3
    sender.join(5)


def test_a_digest_sink_checks_without_keeping() -> None:
    enc = codec.encode({"w": np.arange(50_000, dtype=np.float32)})
    a, b = _pair()
    with a, b:
        threading.Thread(target=bulk.send_payload, args=(a, enc.segments)).start()
        sink = DigestSink(enc.size, enc.digest, codec.WIRE_DIGEST, block=4096)
        bulk.recv_payload(b, sink, idle_s=10)
        sink.finish()
    bad = DigestSink(enc.size, "0" * 64, codec.WIRE_DIGEST)
    bad.add(enc.to_bytes())
    with pytest.raises(codec.DigestMismatch):
        bad.finish()


def test_large_payloads_are_hashed_a_block_behind_the_reads() -> None:
    """Over PIPELINE_MIN_BYTES the digest runs on a thread of its own: the same verdicts."""
    from fedgpu.core.digest_pipe import PIPELINE_MIN_BYTES

    rng = np.random.default_rng(7)
    enc = codec.encode({"w": rng.standard_normal((PIPELINE_MIN_BYTES + (3 << 20)) // 4,
                                                dtype=np.float32)})
    assert enc.size > PIPELINE_MIN_BYTES
    for expected in (enc.digest, "0" * 64):
        for make in (lambda d: codec.Assembler(enc.size, d, 1 << 30, enc.algorithm),
                     lambda d: DigestSink(enc.size, d, enc.algorithm, block=1 << 20)):
            a, b = _pair()
            with a, b:
                sender = threading.Thread(target=bulk.send_payload, args=(a, enc.segments))
                sender.start()
                sink = make(expected)
                bulk.recv_payload(b, sink, idle_s=10)
                sender.join()
                if expected == enc.digest:
                    out = sink.finish()
                    if out is not None:  # the assembler keeps the bytes, the sink does not
                        assert bytes(out) == enc.to_bytes()
                        sink.release()
                else:
                    with pytest.raises(codec.DigestMismatch):
                        sink.finish()
    # One byte changed in the middle of a large payload is caught too.
    data = bytearray(enc.to_bytes())
    data[len(data) // 2] ^= 1
    a, b = _pair()
    with a, b:
        sender = threading.Thread(target=b.sendall, args=(data,))
        sender.start()
        sink = DigestSink(enc.size, enc.digest, enc.algorithm, block=1 << 20)
        bulk.recv_payload(a, sink, idle_s=10)
        sender.join()
        with pytest.raises(codec.DigestMismatch):
            sink.finish()


def test_a_model_payload_from_its_file_sends_the_same_bytes(tmp_path: Path) -> None:
    enc = codec.encode({"w": np.arange(700_000, dtype=np.float32)})
    path = tmp_path / "global.safetensors"
    path.write_bytes(enc.to_bytes())
    payload = ModelPayload.from_file(path, enc.digest, codec.WIRE_DIGEST)
    assert payload.size == enc.size
    assert b"".join(payload.chunks(1 << 16)) == enc.to_bytes()
    # Replaced by a newer model while downloads still use it: the open file stays readable.
    path.unlink()
    a, b = _pair()
    with a, b:
        threading.Thread(target=payload.send, args=(a,)).start()
        asm = codec.Assembler(enc.size, enc.digest, 1 << 30, enc.algorithm)
        bulk.recv_payload(b, asm, idle_s=10)
        assert bytes(asm.finish()) == enc.to_bytes()


def test_host_of_a_grpc_target() -> None:
    assert bulk.host_of("agg.example.org:50051") == "agg.example.org"
    assert bulk.host_of("[::1]:50051") == "::1"
    assert bulk.host_of("127.0.0.1:1") == "127.0.0.1"


def test_wire_dtype_halves_float32_and_leaves_the_rest() -> None:
    weights = {"w": np.array([1.0, 1e6, -3.5], np.float32), "steps": np.array([7], np.int64)}
    bf = to_wire(weights, "bf16")
    assert codec.dtype_name(bf["w"].dtype) == "BF16" and bf["steps"].dtype == np.int64
    fp = to_wire(weights, "fp16")
    # Clipped to float16's range, never infinity.
    assert fp["w"].dtype == np.float16 and np.isfinite(fp["w"]).all()
    assert to_wire(weights, None)["w"] is weights["w"]
    spec = codec.spec(weights)
    assert wire_spec(spec, "bf16") == {"w": ("BF16", (3,)), "steps": ("I64", (1,))}
    assert wire_spec(spec, None) == spec


@pytest.mark.parametrize(("raw", "message"), [
    ({"wire_dtype": "int8"}, "one of bf16, fp16"),
    ({"wire_dtype": "bf16", "mode": "ring", "min_nodes": 2, "iterations": 10},
     "absent in ring mode"),
])
def test_the_job_refuses_a_wire_dtype_it_cannot_honour(raw: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=message):
        parse_job({"task": "digits", **raw})
    assert parse_job({"task": "digits", "wire_dtype": "fp16"}).wire_dtype == "fp16"
    assert parse_job({"task": "digits"}).wire_dtype is None


def test_turned_away_at_the_door_is_tried_again_with_growing_jittered_pauses() -> None:
    from fedgpu.node.bulk_client import DOOR_TRIES, knock

    pauses: list[float] = []
    calls = iter([bulk.TurnedAway("gate full")] * 3 + ["done"])

    def attempt() -> str:
        got = next(calls)
        if isinstance(got, Exception):
            raise got
        return got

    assert knock(attempt, sleep=pauses.append) == "done"
    assert len(pauses) == 3 and pauses[0] < pauses[2] and all(p > 0 for p in pauses)

    # Turned away every time: the last refusal after DOOR_TRIES tries; other errors at once.
    for error, expected in ((bulk.TurnedAway("full"), DOOR_TRIES),
                            (bulk.BulkProtocolError("bad magic"), 1)):
        tries: list[int] = []

        def fail(error: Exception = error, tries: list[int] = tries) -> str:
            tries.append(1)
            raise error

        with pytest.raises(type(error)):
            knock(fail, sleep=lambda s: None)
        assert len(tries) == expected


def test_a_connection_closed_before_the_first_status_is_turned_away() -> None:
    server, client = socket.socketpair()
    with server, client:
        # The server reads the ticket, then hangs up without a word (its slots were full).
        def hang_up() -> None:
            bulk.read_ticket(server)
            server.shutdown(socket.SHUT_RDWR)

        t = threading.Thread(target=hang_up)
        t.start()
        client.settimeout(10)
        with pytest.raises(bulk.TurnedAway):
            bulk.first_status(client, "ticket-1")
        t.join()
    # A status cut off after its first bytes is a broken stream, not a door.
    server, client = socket.socketpair()
    with server, client:
        server.sendall(b"\x00\x00")
        server.shutdown(socket.SHUT_RDWR)
        client.settimeout(10)
        with pytest.raises(bulk.BulkProtocolError):
            bulk.read_status(client, bulk.TurnedAway)
