"""Model downloads as the aggregator sends them (issue 37.4): bytes actually sent of each site's
download, on either path (the bulk port's blocks, the gRPC task stream's chunks), so that
`fedgpu rounds` and the dashboard show counted progress instead of an estimate.

Cheap by design: one counter per transfer, bumped once per chunk or block by the sender and read
only when a view asks (server/views/round_progress.py). Each site's last finished download is
kept (bounded) so a round's view shows the rate it was measured at after it ended.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

# Finished downloads remembered (one per site name, oldest dropped first).
MAX_KEPT = 4096


@dataclass
class Download:
    """One download in flight (or just ended): `offset` bytes the site already held (a resumed
    transfer), `sent` the bytes sent since, of a payload of `size`."""

    node: str
    size: int
    offset: int = 0
    sent: int = 0
    began: float = field(default_factory=time.perf_counter)
    started_at: float = field(default_factory=time.time)
    ended: float = 0.0
    ended_at: float = 0.0
    complete: bool = False

    def add(self, n: int) -> None:
        """`n` more bytes handed to the connection (called per chunk or block)."""
        self.sent += n

    @property
    def done(self) -> int:
        return min(self.offset + self.sent, self.size)

    @property
    def seconds(self) -> float:
        return max((self.ended or time.perf_counter()) - self.began, 0.0)

    @property
    def rate(self) -> float:
        """Bytes per second sent on this connection (0 before the first second's worth)."""
        s = self.seconds
        return self.sent / s if s > 0 else 0.0


class Downloads:
    """The downloads in flight, by site, and each site's last finished one."""

    def __init__(self, max_kept: int = MAX_KEPT) -> None:
        self._active: dict[int, Download] = {}
        self._last: OrderedDict[str, Download] = OrderedDict()
        self._max_kept = max_kept

    @contextlib.contextmanager
    def track(self, node: str, size: int, offset: int = 0) -> Iterator[Download]:
        """Count a download of `size` bytes from `offset` on while the block runs; it counts as
        complete when all its bytes were handed over, whether or not the block then raised."""
        d = Download(node, size, offset)
        self._active[id(d)] = d
        try:
            yield d
        finally:
            self._active.pop(id(d), None)
            d.ended, d.ended_at = time.perf_counter(), time.time()
            d.complete = d.done >= d.size
            if d.complete:
                self._last.pop(node, None)
                self._last[node] = d
                while len(self._last) > self._max_kept:
                    self._last.popitem(last=False)

    def in_flight(self) -> dict[str, Download]:
        """Downloads now running, by site name (the latest started when a site has two)."""
        out: dict[str, Download] = {}
        for d in self._active.values():
            if d.node not in out or d.began > out[d.node].began:
                out[d.node] = d
        return out

    def last(self, node: str) -> Download | None:
        """`node`'s last download sent whole; None if none is kept."""
        return self._last.get(node)
