"""Ending a relayed TCP connection the way a broken link does, for the test relays
(tests/net/wan_link.py, tests/net/fault_proxy.py)."""

from __future__ import annotations

import array
import contextlib
import fcntl
import socket
import struct
import termios
import time


def unacked(sock: socket.socket, wait_s: float) -> int:
    """Bytes handed to `sock` that its peer's kernel has not acknowledged, after waiting up to
    `wait_s` for them to go. A reset loses exactly these: what the peer acknowledged stays
    readable there until its application reads it (Linux keeps the receive queue past a RST).
    They sit in the relay's last hop only when the receiving application is slow to read (a
    loaded CI machine: its receive window fills), and would otherwise count as delivered."""
    end = time.monotonic() + wait_s
    queued = array.array("i", [0])
    while True:
        try:
            fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, queued)  # SIOCOUTQ
        except OSError:
            return 0
        if queued[0] == 0 or time.monotonic() >= end:
            return int(queued[0])
        time.sleep(0.01)


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset instead of the orderly end of the stream. SHUT_RD first wakes a
    thread blocked in recv() on it (it sends nothing): a close() alone would wait for that
    recv to return before the kernel lets go of the socket and sends the reset."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()
