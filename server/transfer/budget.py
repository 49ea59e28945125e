"""The upload memory budget: bytes reserved first come, first served (server/transfer/uploads.py
reserves an upload's buffer against it at the upload's first byte)."""

from __future__ import annotations

import asyncio
from collections import deque


class ByteBudget:
    """A first-come, first-served reservation of bytes. One reservation larger than the whole
    budget is still granted when nothing else holds any, so no model is too big to upload
    (where no spool takes it, server/transfer/spool.py); a `strict` budget never grants more
    than its total (the spool's disk)."""

    def __init__(self, total: int, strict: bool = False) -> None:
        self.total = total
        self.strict = strict
        self.used = 0
        # The most ever reserved at once (`status` memory_peak_bytes): what the budget held to.
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, size: int) -> bool:
        return self.used + size <= self.total or self.used == 0 and not self.strict

    async def acquire(self, size: int, timeout: float) -> None:
        """Reserve `size` bytes; TimeoutError if they did not free up within `timeout`."""
        if not self._waiters and self._fits(size):
            self._take(size)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (size, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout=max(timeout, 0.0))
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif fut.done() and not fut.cancelled():
                self.release(size)  # granted just as we gave up
            self._wake()
            raise

    def _take(self, size: int) -> None:
        self.used += size
        self.peak = max(self.peak, self.used)

    def release(self, size: int) -> None:
        self.used -= size
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            size, fut = self._waiters.popleft()
            self._take(size)
            fut.set_result(None)
