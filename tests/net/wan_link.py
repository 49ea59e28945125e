"""A user-space WAN emulator for tests: one site's link to the aggregator as TCP relays (one
per port the site reaches: gRPC and bulk) that add one-way delay, jitter, loss and a rate
limit, cut a connection at a byte offset, or partition the site for a while; and count every
byte that crossed, per port and direction, so a test can tell how many were sent twice.

Why user space: this kernel has no `netem` (only `tc tbf`, which tests use for rate on a veth).
What is emulated, and what is not (docs/explanation/network-tests.md says more):
- Delay and jitter: each chunk read from the sender is delivered `delay_s` (+- `jitter_s`)
  later, in order (TCP never reorders what the application sees).
- Loss: TCP hides loss from the application; what shows is the stream stalling until the
  retransmission arrives. Each MSS-sized segment is lost with probability `loss`; a chunk
  holding a lost one (and everything behind it: head-of-line blocking) is delivered
  `retransmit_s` later (one RTT by default: a fast retransmit, SACK recovering the rest). The
  sending rate does not drop after a loss: the emulated sender is BBR-like, not CUBIC (a CUBIC
  flow over a real 200 ms RTT with 1% loss gets ~0.7 Mbit/s by the Mathis bound, whatever
  fedgpu does).
- Rate: a token bucket per direction, shared by all of the link's connections (a site's
  uplink is one pipe), applied as bytes enter the link; what is in flight is bounded like a
  receive window (`window` bytes), so a slow reader slows the sender.
- Cuts: after `after` bytes of one direction of a connection on one port the connection is
  reset both ways (SO_LINGER 0); bytes still in flight inside the link are lost with it. The
  bytes before the cut are delivered: the relay waits (briefly) for the receiver's kernel to
  take them before the reset, and counts those it did not take as lost.
- Partition: every open connection of the link is reset, and for `seconds` a new one is
  accepted and reset at once (refused); then the link is up again.

Threads only, no dependencies. It listens where the site can reach it (in the netns suite:
the root namespace's end of the site's veth) and connects to the aggregator's address.
"""

from __future__ import annotations

import collections
import contextlib
import math
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum

from tests.net.resets import reset, unacked

READ = 1 << 16
# Pacing and delay act on chunks of at most this many bytes: small enough that a rate of
# 2 Mbit/s is smooth (8 KiB = 33 ms), large enough to keep the relay cheap at 1 Gbit/s.
CHUNK = 8 << 10
MSS = 1448
# How long a cut waits for the bytes it let through to reach the receiver's kernel.
DRAIN_S = 2.0


class Way(StrEnum):
    UP = "up"        # site -> aggregator (an upload)
    DOWN = "down"    # aggregator -> site (a download)


@dataclass(frozen=True)
class Profile:
    delay_s: float = 0.0          # one way
    jitter_s: float = 0.0         # uniform +-, never below zero, never reordering
    loss: float = 0.0             # per MSS-sized segment
    rate_bps: float | None = None  # bits per second, each direction; None: unlimited
    retransmit_s: float | None = None  # a loss's stall; None: one RTT (2 * delay_s)
    window: int = 4 << 20         # bytes in flight inside the link, at most, per direction

    @property
    def stall_s(self) -> float:
        return self.retransmit_s if self.retransmit_s is not None else 2 * self.delay_s


# The WAN: 100 ms one way, jitter, 1% loss, 50 Mbit/s per site.
WAN = Profile(delay_s=0.1, jitter_s=0.01, loss=0.01, rate_bps=50e6)
LAN = Profile()


@dataclass
class Cut:
    """A cut (reset) or, with `hold`, a stall: the bytes past `after` wait until release()."""
    port: str        # the relay's label ("grpc", "bulk")
    way: Way
    after: int       # bytes of this direction of one connection before the cut
    hold: bool = False
    done: bool = False
    at: float = 0.0  # time.time() of the cut
    reached: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


@dataclass
class Carried:
    """One connection through the link: when, how many bytes each way, whether it was cut."""
    port: str
    opened: float
    closed: float = 0.0
    bytes: dict[Way, int] = field(default_factory=lambda: {w: 0 for w in Way})
    # What reached the other end; less than `bytes` by what was in flight at a cut.
    delivered: dict[Way, int] = field(default_factory=lambda: {w: 0 for w in Way})
    cut: bool = False


class Bucket:
    """A token bucket in bytes; take() blocks until the bytes may enter the link."""

    def __init__(self, rate_bps: float | None, burst: int = 4 * CHUNK) -> None:
        self.rate = rate_bps / 8 if rate_bps else None
        self.burst = burst
        self.tokens = float(burst)
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int, stop: threading.Event) -> None:
        if self.rate is None:
            return
        while not stop.is_set():
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
                self.last = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                wait = (n - self.tokens) / self.rate
            time.sleep(min(wait, 0.05))


@dataclass
class Link:
    """One site's link: its relays, shared rate limits, cuts, partition and byte counts."""

    profile: Profile = LAN
    seed: int = 0
    cuts: list[Cut] = field(default_factory=list)
    # Bytes that entered the link (what the sender sent), per (port, way), all connections.
    carried: dict[tuple[str, Way], int] = field(default_factory=collections.Counter)
    connections: dict[str, int] = field(default_factory=collections.Counter)
    refused: int = 0
    losses: int = 0  # chunks stalled by an emulated loss
    history: list[Carried] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.rng = random.Random(self.seed)
        self.buckets = {w: Bucket(self.profile.rate_bps) for w in Way}
        self.down_until = 0.0
        self.relays: list[Relay] = []
        self.live: set[_Connection] = set()

    def relay(self, label: str, listen: tuple[str, int], target: tuple[str, int]) -> Relay:
        r = Relay(self, label, listen, target)
        self.relays.append(r)
        return r

    def cut(self, port: str, way: Way, after: int) -> Cut:
        """Reset the next connection on `port` whose `way` direction reaches `after` bytes."""
        c = Cut(port, way, after)
        with self.lock:
            self.cuts.append(c)
        return c

    def hold(self, port: str, way: Way, after: int) -> Cut:
        """Stall the next connection on `port` whose `way` reaches `after` bytes there, until
        the returned Cut's release() (a transfer kept mid-way while the test acts)."""
        c = Cut(port, way, after, hold=True)
        with self.lock:
            self.cuts.append(c)
        return c

    def transfers(self, port: str) -> list[Carried]:
        with self.lock:
            return [c for c in self.history if c.port == port]

    def partition(self, seconds: float) -> None:
        """The site drops off the network: open connections reset, new ones refused."""
        with self.lock:
            self.down_until = time.monotonic() + seconds
            live = list(self.live)
        for conn in live:
            conn.reset()

    @property
    def down(self) -> bool:
        return time.monotonic() < self.down_until

    def total(self, port: str, way: Way) -> int:
        with self.lock:
            return self.carried[(port, way)]

    def close(self) -> None:
        self.stop.set()
        for r in self.relays:
            r.close()
        with self.lock:
            live = list(self.live)
        for conn in live:
            conn.reset()

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _armed(self, port: str, way: Way) -> Cut | None:
        with self.lock:
            return next((c for c in self.cuts if not c.done and c.port == port
                         and c.way is way), None)

    def _delay(self, n: int, last_due: float) -> float:
        p = self.profile
        with self.lock:
            jitter = self.rng.uniform(-p.jitter_s, p.jitter_s) if p.jitter_s else 0.0
            lost = p.loss and self.rng.random() < 1 - (1 - p.loss) ** math.ceil(n / MSS)
            self.losses += bool(lost)
        due = time.monotonic() + max(0.0, p.delay_s + jitter) + (p.stall_s if lost else 0.0)
        return max(due, last_due)


class Relay:
    def __init__(self, link: Link, label: str, listen: tuple[str, int],
                 target: tuple[str, int]) -> None:
        self.link, self.label, self.target = link, label, target
        self._listener = socket.create_server(listen, reuse_port=False)
        self._listener.settimeout(0.2)
        self.address = self._listener.getsockname()[:2]
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"wan-{label}")
        self._thread.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        link = self.link
        while not link.stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            if link.down:
                with link.lock:
                    link.refused += 1
                reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                reset(client)
                continue
            upstream.settimeout(None)
            with link.lock:
                link.connections[self.label] += 1
            _Connection(self, client, upstream).start()


class _Connection:
    def __init__(self, relay: Relay, client: socket.socket, upstream: socket.socket) -> None:
        self.relay, self.link = relay, relay.link
        self.client, self.upstream = client, upstream
        self.broken = threading.Event()
        self.cond = threading.Condition()
        self.queues: dict[Way, collections.deque[tuple[float, bytes]]] = {
            w: collections.deque() for w in Way}
        self.queued = {w: 0 for w in Way}
        self.ended = {w: False for w in Way}
        self.finished = 0
        self.record = Carried(relay.label, time.time())

    def start(self) -> None:
        with self.link.lock:
            self.link.live.add(self)
            self.link.history.append(self.record)
        for way in Way:
            for fn in (self._read, self._write):
                threading.Thread(target=fn, args=(way,), daemon=True).start()

    def reset(self) -> None:
        if self.broken.is_set():
            return
        self.broken.set()
        self.record.closed = time.time()
        reset(self.client)
        reset(self.upstream)
        with self.cond:
            self.cond.notify_all()
        with self.link.lock:
            self.link.live.discard(self)

    def _ends(self, way: Way) -> tuple[socket.socket, socket.socket]:
        return (self.client, self.upstream) if way is Way.UP else (self.upstream, self.client)

    def _read(self, way: Way) -> None:
        """Into the link: paced by the rate, stamped with when each chunk arrives."""
        src, _ = self._ends(way)
        link, window, last_due = self.link, self.link.profile.window, 0.0
        try:
            while not self.broken.is_set():
                data = src.recv(READ)
                if not data:
                    break
                for i in range(0, len(data), CHUNK):
                    part = data[i:i + CHUNK]
                    with self.cond:  # the link's window: a slow reader slows the sender
                        while self.queued[way] >= window and not self.broken.is_set():
                            self.cond.wait(0.2)
                    link.buckets[way].take(len(part), self.broken)
                    if self.broken.is_set() or link.down:
                        self.reset()
                        return
                    last_due = link._delay(len(part), last_due)
                    with link.lock:
                        link.carried[(self.relay.label, way)] += len(part)
                        self.record.bytes[way] += len(part)
                    with self.cond:
                        self.queues[way].append((last_due, part))
                        self.queued[way] += len(part)
                        self.cond.notify_all()
        except OSError:
            pass
        with self.cond:
            self.ended[way] = True
            self.cond.notify_all()

    def _write(self, way: Way) -> None:
        """Out of the link: each chunk when it is due; a cut armed for this way applies."""
        _, dst = self._ends(way)
        sent = 0
        cut = self.link._armed(self.relay.label, way)
        try:
            while True:
                with self.cond:
                    while not self.queues[way] and not self.ended[way] \
                            and not self.broken.is_set():
                        self.cond.wait(0.2)
                    if self.broken.is_set():
                        return
                    if not self.queues[way]:
                        break  # the sender ended its direction and all was delivered
                    due, part = self.queues[way].popleft()
                    self.queued[way] -= len(part)
                    self.cond.notify_all()
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                if cut is None:
                    cut = self.link._armed(self.relay.label, way)
                if cut is not None and not cut.done and sent + len(part) >= cut.after:
                    with self.link.lock:
                        if cut.done:  # another connection took it
                            cut = None
                        else:
                            cut.done, cut.at = True, time.time()
                    if cut is not None and cut.hold:
                        head = max(0, cut.after - sent)
                        dst.sendall(part[:head])
                        sent += head
                        self.record.delivered[way] += head
                        part = part[head:]
                        cut.reached.set()
                        while not cut.released.wait(0.2) and not self.broken.is_set():
                            pass
                        cut = None
                    elif cut is not None:
                        dst.sendall(part[: max(0, cut.after - sent)])
                        self.record.delivered[way] += max(0, cut.after - sent)
                        self.record.delivered[way] -= unacked(dst, DRAIN_S)
                        self.record.cut = True
                        self.reset()
                        return
                dst.sendall(part)
                sent += len(part)
                self.record.delivered[way] += len(part)
        except OSError:
            self.reset()
            return
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self.cond:
            self.finished += 1
            last = self.finished == len(Way)
        if last:  # both directions ended in order: close, as the ends did
            self.record.closed = time.time()
            with self.link.lock:
                self.link.live.discard(self)
            self.client.close()
            self.upstream.close()
