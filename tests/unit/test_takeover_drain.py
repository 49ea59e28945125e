"""Before a resumed bulk connection takes over from an older one of its ticket, the older one
reads what already waits for it (server/transfer/drain.py), on real loopback sockets.

Threat model: a resume must not lose bytes the aggregator already holds in its kernel buffers
(they would cross the link twice), and the older connection of a peer gone silent (a reset
that never reached the aggregator) must not hold the take-over up.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from fedgpu.server.transfer.drain import DRAIN_S, drained, queued

SENT = 256 << 10


@pytest.fixture(name="pair")
def pair_fixture() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    accepted.setblocking(False)
    with client, accepted:
        yield client, accepted


def test_queued_counts_unread_bytes(pair: tuple[socket.socket, socket.socket]) -> None:
    client, accepted = pair
    assert queued(accepted) == 0
    client.sendall(b"x" * 1000)
    end = time.monotonic() + 5
    while queued(accepted) < 1000 and time.monotonic() < end:
        time.sleep(0.01)
    assert queued(accepted) == 1000


def test_the_older_reader_finishes_what_waits_for_it(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """A reader behind (small reads, a pause between them) with bytes and the end of the
    stream queued: the take-over waits until it has read them all and ended by itself."""
    client, accepted = pair
    client.sendall(b"x" * SENT)
    client.shutdown(socket.SHUT_WR)
    got = [0]

    async def main() -> bool:
        loop = asyncio.get_running_loop()

        async def reader() -> None:
            while data := await loop.sock_recv(accepted, 16 << 10):
                got[0] += len(data)
                await asyncio.sleep(0.005)

        task = asyncio.create_task(reader())
        await drained(accepted, task)
        return task.done()

    assert asyncio.run(main())
    assert got[0] == SENT


def test_a_silent_older_connection_is_not_waited_for(
        pair: tuple[socket.socket, socket.socket]) -> None:
    _, accepted = pair

    async def main() -> tuple[float, bool]:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(loop.sock_recv(accepted, 1 << 16))
        started = time.monotonic()
        await drained(accepted, task)
        took, done = time.monotonic() - started, task.done()
        task.cancel()
        return took, done

    took, done = asyncio.run(main())
    # Two looks 20 ms apart; the bound is far below DRAIN_S so a wait would show.
    assert not done and took < DRAIN_S / 2
