"""A transfer's progress in the node's log while it runs (issue 37.4): at most one line every
EVERY_S seconds with the bytes done of the total, the rate and the time left, on either path
(gRPC chunks, the bulk port) and in either direction.

A transfer that ends within its first interval logs nothing here: its one line is the measured
rate the wire client logs at the end (node/wire_client.py). One that logged progress and then
stopped short (a break, a refusal) says where it stopped, so a log never ends mid-transfer.

Cheap: the sender or receiver calls `add(n)` per chunk or block; each call is one clock read
and a comparison. Safe to call from the transfer's worker thread (the bulk path).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fedgpu.core.link_rates import mbit

log = logging.getLogger("fedgpu.node.link")

# Seconds between two progress lines of one transfer.
EVERY_S = 5.0


class TransferLog:
    """One transfer's progress lines: `what` ("download over grpc"), `total` bytes of which
    `start` were already held (a resumed transfer)."""

    def __init__(self, what: str, total: int, start: int = 0, every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total = what, total
        self.done = start
        self._start = start
        self._every = every_s
        self._clock = clock
        self._began = clock()
        self._next = self._began + every_s
        self.lines = 0

    def add(self, n: int) -> None:
        """`n` more bytes moved; a line when the interval has passed since the last."""
        self.done += n
        now = self._clock()
        if now >= self._next and self.done < self.total:
            self._next = now + self._every
            self.lines += 1
            log.info("%s: %s", self.what, self._figures(now))

    def end(self) -> None:
        """The transfer is over: a last line if it logged progress and stopped short."""
        if self.lines and self.done < self.total:
            log.info("%s stopped: %s", self.what, self._figures(self._clock()))

    def _figures(self, now: float) -> str:
        seconds = max(now - self._began, 1e-9)
        rate = (self.done - self._start) / seconds
        left = f", ~{(self.total - self.done) / rate:.0f} s left" if rate > 0 else ""
        return (f"{self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB in {seconds:.0f} s at "
                f"{mbit(rate) if rate > 0 else '?'}{left}")
