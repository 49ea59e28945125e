"""Who may hold the bulk port before presenting a ticket, and for how long.

The bulk port needs no credential to connect, so what a stranger can hold there is bounded:
- a connection must present its ticket within a deadline counted from accept (a per-read
  timeout let one byte a second keep it open forever): `Watchdog` shuts the socket down when
  the deadline passes, whatever the blocked thread was doing (a TLS handshake included);
- connections without a ticket yet are limited per address and in total (`PreTicketGate`),
  and the port's transfer slots are counted only once a ticket was presented, so 64 silent
  connections no longer turn every node away as busy;
- a transfer keeps a minimum rate (fedgpu.core.bulk.MIN_RATE_BPS): a download's socket is shut
  when it falls behind it (the watchdog again), an upload's receive loop checks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter

# Unticketed connections one address may hold at once: a site behind one NAT opens a few at
# the start of a round (each done in milliseconds); more is a flood.
MAX_PENDING_PER_ADDRESS = 8
# Unticketed connections in all: each holds a handshake thread until its deadline.
MAX_PENDING = 128


class PreTicketGate:
    """Counts connections that have not presented a ticket, per address."""

    def __init__(self, per_address: int = MAX_PENDING_PER_ADDRESS,
                 total: int = MAX_PENDING) -> None:
        self.per_address = per_address
        self.total = total
        self._by_address: Counter[str] = Counter()

    @property
    def pending(self) -> int:
        return sum(self._by_address.values())

    def admit(self, address: str) -> str | None:
        """Count one more from `address`; the reason it is refused instead, if it is."""
        if self._by_address[address] >= self.per_address:
            return (f"{self.per_address} connections from {address} have not presented a "
                    "ticket yet")
        if self.pending >= self.total:
            return f"{self.total} connections have not presented a ticket yet"
        self._by_address[address] += 1
        return None

    def release(self, address: str) -> None:
        self._by_address[address] -= 1
        if self._by_address[address] <= 0:
            del self._by_address[address]


class Watchdog:
    """Shuts a socket down at a moment of the event loop's clock unless cancelled first: a
    thread blocked on the socket then returns at once (and `expired` says why)."""

    def __init__(self, sock: socket.socket, after_s: float) -> None:
        self.expired = False
        self._sock = sock
        self._handle = asyncio.get_running_loop().call_later(after_s, self._fire)

    def _fire(self) -> None:
        self.expired = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._handle.cancel()
