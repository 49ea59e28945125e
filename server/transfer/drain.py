"""Before a resumed bulk connection takes its transfer over from an older one of the same ticket,
let the older one read what is already waiting for it (issue 37).

Why: a node that sees its connection reset resumes at once (node/resume_backoff.py). The older
connection on this side may not have read all the node sent before the break (its reader is
behind on a loaded host, or the reset reached only the node while what crossed before it is
still arriving here). Shutting it down at once ends its stream there: what it has queued is
still read, but nothing that was still on its way (a full receive window holds the rest back
in the sender's buffers) arrives any more, and the resume's go-ahead names a smaller offset:
seen on loopback behind the fault proxy as 1.4 MB of a 4 MiB upload sent twice (the 5% target
missed; 437 KB queued at one take-over) where the node's old fixed 0.5 s pause had hidden
it. An older connection whose peer went silent (a reset that never reached this side, the
case the take-over exists for) has nothing queued and is ended after two looks 20 ms apart,
so the take-over is not held up by it.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import socket
import termios
from typing import Any

# How often the older connection's receive queue is looked at, and for how long in all: its
# reader empties a full queue (a few MB) in milliseconds unless the host is badly overloaded.
POLL_S = 0.02
DRAIN_S = 2.0


def queued(sock: socket.socket) -> int:
    """Bytes in the socket's receive queue, not yet read (0 when it cannot be asked)."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    except OSError:
        return 0
    return buf[0]


async def drained(sock: socket.socket, reader: asyncio.Task[Any]) -> None:
    """Wait while `reader` (the older connection's task) still has bytes waiting on `sock`: until
    it ends, or the queue was empty at two looks in a row, or DRAIN_S passed."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DRAIN_S
    empty = 0
    while not reader.done() and loop.time() < end:
        empty = empty + 1 if queued(sock) == 0 else 0
        if empty >= 2:
            return
        await asyncio.wait({reader}, timeout=POLL_S)
