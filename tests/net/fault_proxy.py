"""A fault-injecting TCP proxy for tests: the link between a site and the aggregator, with a
cut where the test wants one, and the bytes that crossed it counted.

Loopback only (it listens on 127.0.0.1, or another address of 127.0.0.0/8, and forwards to one
target), threads only, no dependencies: a network-namespace suite can run it as it is between two
namespaces' veths. A given `port` lets it stand where a client expects a fixed port: a site reaches
the aggregator's bulk port at the host of its aggregator address and the port the aggregator
advertised, so a proxy on 127.0.0.2:<bulk port> stands in front of an aggregator bound to
127.0.0.1 for a site given the aggregator address 127.0.0.2:<its gRPC proxy>.

A cut is armed per direction: after `after` bytes of the n-th connection went one way, that
connection is cut. What each side sees is the `how` of the cut:
- CutStyle.RESET: both sides get a TCP reset (SO_LINGER 0); bytes still in the receiver's
  kernel buffer are lost with it, as on a real reset.
- CutStyle.SENDER_RESET (default): the receiver gets every byte that crossed and then the end
  of the stream, the sender a reset: the cut is exactly at `after`, so a test can count the
  bytes sent twice without the kernel's buffers blurring the figure.

A slow link: `rate` (bytes/s) limits each direction of each connection with a token bucket
(a burst of BURST bytes, then `rate`), as `tc tbf` would on a real interface; `slow(way, rate)`
sets one direction's rate from then on, also mid-transfer.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum

from tests.net.resets import reset

READ = 1 << 16
# The token bucket's depth: what a rate-limited link lets through at once.
BURST = 16 << 10


class Way(StrEnum):
    UP = "up"        # client -> target (an upload)
    DOWN = "down"    # target -> client (a download)


class CutStyle(StrEnum):
    RESET = "reset"
    SENDER_RESET = "sender_reset"


@dataclass
class Cut:
    way: Way
    after: int                 # bytes of this direction before the cut
    connection: int = 0        # which connection (0: the first that carries this many)
    how: CutStyle = CutStyle.SENDER_RESET
    done: bool = False


@dataclass
class FaultProxy:
    target: tuple[str, int]
    host: str = "127.0.0.1"
    cuts: list[Cut] = field(default_factory=list)
    # Bytes that crossed, each way, over all connections (read from the sending side).
    carried: dict[Way, int] = field(default_factory=lambda: {Way.UP: 0, Way.DOWN: 0})
    connections: int = 0
    # Bytes/s each way of each connection (None: as fast as loopback).
    rate: float | None = None
    # Bytes per second each way may carry, per connection (absent or 0: as fast as it goes).
    rates: dict[Way, float] = field(default_factory=dict)
    # The port to listen on (0: a free one, read back from `port` once listening).
    port: int = 0

    def __post_init__(self) -> None:
        if not _loopback(self.host):
            raise ValueError("the fault proxy is for loopback only")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server((self.host, self.port))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fault-proxy")
        self._thread.start()

    def cut(self, way: Way, after: int, connection: int = 0,
            how: CutStyle = CutStyle.SENDER_RESET) -> Cut:
        """Arm a cut of the `connection`-th connection after `after` bytes going `way`."""
        c = Cut(way, after, connection, how)
        with self._lock:
            self.cuts.append(c)
        return c

    def slow(self, way: Way, bytes_per_s: float) -> None:
        """Carry at most `bytes_per_s` going `way` on each connection from now on (a slow
        link: the test can act while a transfer is half way)."""
        with self._lock:
            self.rates[way] = bytes_per_s

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                index = self.connections
                self.connections += 1
                self._socks += [client, upstream]
            conn = _Connection(self, index, client, upstream)
            for way in Way:
                threading.Thread(target=conn.pump, args=(way,), daemon=True).start()

    def _armed(self, index: int, way: Way) -> Cut | None:
        with self._lock:
            for c in self.cuts:
                if not c.done and c.way is way and c.connection == index:
                    return c
        return None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Bucket:
    """A token bucket: take(n) returns once n bytes' worth of tokens have accrued."""

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.at = rate, float(BURST), time.monotonic()

    def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(float(BURST), self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        if self.tokens < 0:
            time.sleep(-self.tokens / self.rate)


class _Connection:
    def __init__(self, proxy: FaultProxy, index: int, client: socket.socket,
                 upstream: socket.socket) -> None:
        self.proxy, self.index = proxy, index
        self.client, self.upstream = client, upstream
        self.sent = {Way.UP: 0, Way.DOWN: 0}
        self.broken = threading.Event()

    def pump(self, way: Way) -> None:
        src, dst = (self.client, self.upstream) if way is Way.UP else (self.upstream, self.client)
        cut = self.proxy._armed(self.index, way)
        bucket: _Bucket | None = None
        try:
            while not self.broken.is_set():
                # `slow()` may change the rate mid-transfer: the bucket follows it.
                rate = self.proxy.rates.get(way) or self.proxy.rate or 0
                if rate and (bucket is None or bucket.rate != rate):
                    bucket = _Bucket(rate)
                # Slowed: reads small enough that the pauses stay short at slow rates.
                data = src.recv(min(BURST, max(512, int(rate / 20))) if rate else READ)
                if not data:
                    break
                if rate and bucket is not None:
                    bucket.take(len(data))
                with self.proxy._lock:
                    self.proxy.carried[way] += len(data)
                if cut is not None and self.sent[way] + len(data) >= cut.after:
                    dst.sendall(data[: cut.after - self.sent[way]])
                    self.sent[way] = cut.after
                    self._cut(cut, src, dst)
                    return
                dst.sendall(data)
                self.sent[way] += len(data)
        except OSError:
            pass
        if not self.broken.is_set():
            # The orderly end of one direction is passed on; the other keeps flowing.
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def _cut(self, cut: Cut, src: socket.socket, dst: socket.socket) -> None:
        cut.done = True
        self.broken.set()
        reset(src)
        if cut.how is CutStyle.RESET:
            reset(dst)
        else:
            # The end of the stream after the bytes already queued; closed later (by
            # close()), since closing with unread bytes would turn it into a reset.
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
