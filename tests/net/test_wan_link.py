"""The WAN emulator itself (tests/net/wan_link.py), on loopback: the delay, rate, cuts and
partition that the network scenarios rely on are what they say, so a scenario's figures mean
something. Needs no namespaces (runs everywhere)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.net.wan_link import Link, Profile, Way

pytestmark = [pytest.mark.net, pytest.mark.timeout(60)]


@pytest.fixture(name="sink")
def sink_fixture() -> Iterator[tuple[socket.socket, list[int]]]:
    """A server that reads everything each connection sends and answers b'ok' at its end."""
    server = socket.create_server(("127.0.0.1", 0))
    got: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            n = 0
            with conn:
                try:
                    while data := conn.recv(1 << 16):
                        n += len(data)
                    conn.sendall(b"ok")
                except OSError:
                    pass
            got.append(n)

    threading.Thread(target=serve, daemon=True).start()
    yield server, got
    server.close()


def _send(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        return s.recv(16)


def test_delay_and_rate_are_applied(sink: tuple[socket.socket, list[int]]) -> None:
    server, got = sink
    with Link(Profile(delay_s=0.1, rate_bps=8e6)) as link:
        relay = link.relay("bulk", ("127.0.0.1", 0), server.getsockname())
        # Round trip of a tiny message: two one-way delays.
        start = time.monotonic()
        assert _send(relay.address[1], b"x") == b"ok"
        rtt = time.monotonic() - start
        assert 0.2 <= rtt < 0.5, rtt
        # 1 MB at 8 Mbit/s: one second at the rate, plus the delays.
        start = time.monotonic()
        assert _send(relay.address[1], b"y" * 1_000_000) == b"ok"
        took = time.monotonic() - start
        assert 1.0 <= took < 1.8, took
        assert got[-1] == 1_000_000
        assert link.total("bulk", Way.UP) == 1_000_001


def test_loss_stalls_the_stream_without_losing_bytes(
        sink: tuple[socket.socket, list[int]]) -> None:
    server, got = sink
    clean = Profile(delay_s=0.02, rate_bps=40e6)
    lossy = Profile(delay_s=0.02, rate_bps=40e6, loss=0.01, retransmit_s=0.04)
    took, losses = {}, {}
    for name, profile in (("clean", clean), ("lossy", lossy)):
        with Link(profile, seed=1) as link:
            relay = link.relay("bulk", ("127.0.0.1", 0), server.getsockname())
            start = time.monotonic()
            assert _send(relay.address[1], b"z" * 2_000_000) == b"ok"
            took[name] = time.monotonic() - start
            losses[name] = link.losses
        assert got[-1] == 2_000_000
    # ~1% of 1381 segments: a few dozen stalls of 40 ms each.
    assert losses["clean"] == 0 and 5 <= losses["lossy"] <= 40, losses
    # Losses hold the stream back (head of line) but the rate keeps the pipe full: the stalls
    # overlap the transfer instead of adding up (40 x 40 ms would be 1.6 s).
    assert took["lossy"] < took["clean"] + 0.5, took


def test_a_cut_resets_the_connection_at_its_offset(
        sink: tuple[socket.socket, list[int]]) -> None:
    server, got = sink
    with Link() as link:
        relay = link.relay("bulk", ("127.0.0.1", 0), server.getsockname())
        cut = link.cut("bulk", Way.UP, 300_000)
        with pytest.raises(OSError):
            _send(relay.address[1], b"c" * 1_000_000)
        assert cut.done
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        # The aggregator's side saw at most the bytes before the cut, then a reset.
        assert got and got[-1] <= 300_000
        # A cut fires once: the next connection goes through.
        assert _send(relay.address[1], b"d" * 1000) == b"ok"


def test_a_partition_drops_and_refuses_then_heals(
        sink: tuple[socket.socket, list[int]]) -> None:
    server, _ = sink
    with Link() as link:
        relay = link.relay("grpc", ("127.0.0.1", 0), server.getsockname())
        held = socket.create_connection(relay.address, timeout=5)
        held.sendall(b"a")
        time.sleep(0.2)
        link.partition(1.0)
        with pytest.raises(OSError):  # the open connection was reset
            held.sendall(b"b" * 100_000)
            held.recv(16)
        held.close()
        with pytest.raises(OSError):  # a new one is refused while down
            _send(relay.address[1], b"c")
        assert link.refused >= 1
        time.sleep(1.1)
        assert _send(relay.address[1], b"d") == b"ok"
