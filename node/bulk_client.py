"""The node's side of the bulk data path (fedgpu.core.bulk): the aggregator's bulk port, and
the decision to stop using it.

A node that cannot reach the bulk port (a site firewall that lets one port out) falls back to
gRPC streaming by itself, says so once in its log, and tells the aggregator why with every
poll (`fedgpu nodes` shows it as bulk_error). It tries the bulk port again after registering
anew, since that may be a different aggregator.

A transfer that breaks off after it began resumes on the same ticket (fedgpu.core.bulk: the
ticket outlives the broken connection for RESUME_TTL_S): a download from the bytes this node
already holds and hashed, an upload from the bytes the aggregator says it kept. Only the bytes
in flight at the break cross twice. When to resume is node/resume_backoff.py's rule, shared with
the gRPC path: at once after a connection that moved bytes, backing off after one that did not.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from fedgpu.core import bulk, codec
from fedgpu.core.digest_sink import DigestSink
from fedgpu.core.tls import TlsFiles
from fedgpu.node.resume_backoff import Progress

log = logging.getLogger("fedgpu.node.bulk")

# Transfers that reached the port but broke off, in a row, before the node stops trying it.
MAX_BROKEN = 3
# A connection turned away at the door (the port's per-address gate or its transfer slots were
# full: many sites behind one NAT starting a round at once) is tried again after a jittered,
# growing pause, up to this many times (about 6 s in all) before it counts as broken off.
DOOR_TRIES = 7
DOOR_PAUSE_S = 0.05
DOOR_PAUSE_MAX_S = 2.0
# A broken transfer is resumed on its ticket up to this many times before the break is handed
# to the caller (which asks for a new ticket, or falls back to gRPC). The pause before each is
# node/resume_backoff.py's: none after a connection that moved bytes, 0.5 s then 1 s after
# resumes that moved none (all five failing: 3.5 s asleep, within core/lifetime.py's
# STOP_LIMIT_S for a stopped node's transfer thread).
RESUMES = 5

T = TypeVar("T")


def knock(attempt: Callable[[], T], tries: int = DOOR_TRIES,
          sleep: Callable[[float], None] = time.sleep) -> T:
    """`attempt()`, again while the port turns it away; the last TurnedAway if it always does."""
    for i in range(tries - 1):
        try:
            return attempt()
        except bulk.TurnedAway:
            pause = min(DOOR_PAUSE_MAX_S, DOOR_PAUSE_S * 2 ** i)
            # Full jitter: sites turned away together must not knock again together.
            sleep(random.uniform(pause / 2, pause))
    return attempt()


class BulkRpcError(grpc.RpcError):
    """A bulk transfer's outcome in the shape of the gRPC error the same outcome gets on the
    gRPC path, so callers handle one kind of error (code(), details())."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    @classmethod
    def of(cls, status: bulk.Status) -> BulkRpcError:
        code = getattr(grpc.StatusCode, status.code, grpc.StatusCode.UNKNOWN)
        return cls(code, status.message or status.reason)


class BulkPath:
    def __init__(self, address: str, tls: TlsFiles | None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.host = bulk.host_of(address)
        self.tls = tls
        # How a pause before a resume is waited (tests record the pauses instead).
        self.sleep = sleep
        self.port = 0
        self.error: str | None = None
        self._broken = 0
        # Transfers resumed after a break (tests and `fedgpu status` of the node read it).
        self.resumed = 0

    def reset(self, port: int) -> None:
        """A registration told us the aggregator's bulk port (0: none)."""
        self.port = port
        self.error = None
        self._broken = 0

    @property
    def usable(self) -> bool:
        return self.port > 0 and self.error is None

    def fall_back(self, why: str) -> None:
        if self.error is None:
            log.warning("bulk data path unusable (%s): moving weights over gRPC from now on "
                        "(is TCP port %d of %s open between this site and the aggregator?)",
                        why, self.port, self.host)
        self.error = why

    def _broke(self, exc: BaseException) -> None:
        self._broken += 1
        if self._broken >= MAX_BROKEN:
            self.fall_back(f"{self._broken} transfers broke off in a row, the last: {exc}")

    def _resuming(self, attempt: Callable[[], T], reached: Callable[[], int],
                  sleep: Callable[[float], None] | None = None, always: bool = False) -> T:
        """`attempt()`, resumed on the same ticket when its connection breaks off (up to
        RESUMES times) while there is something to resume from: bytes reached (`reached()`,
        the payload's bytes this transfer has moved so far) or, with `always`, whatever the
        aggregator kept (an upload: its go-ahead names the offset). A port that cannot be
        reached at the first attempt is unusable (BulkUnreachable: fall back); at a resume it
        was reachable a moment ago, so the aggregator is restarting or the link is down: a
        break like any other (ConnectionError once the resumes are spent)."""
        last: BaseException | None = None
        pace = Progress(reached())
        for i in range(RESUMES + 1):
            try:
                return attempt()
            except bulk.BulkUnreachable as exc:
                if i == 0:
                    raise
                last = exc
            except (OSError, bulk.BulkProtocolError, codec.Truncated) as exc:
                if not always and reached() <= 0:
                    raise
                last = exc
            if i == RESUMES:
                break
            # At once when the broken connection moved bytes (a reset, a flapping link: the
            # aggregator is most likely there), later when it moved none (down or refusing).
            pause = pace.pause_after(reached())
            log.info("bulk transfer broke off (%s); resuming on the same ticket%s", last,
                     f" in {pause:g}s" if pause else "")
            self.resumed += 1
            (sleep or self.sleep)(pause)
        raise ConnectionError(f"bulk transfer broke off {RESUMES + 1} times: {last}")

    def download(self, ticket: str, port: int, asm: codec.Assembler | DigestSink,
                 idle_s: float = 60.0, on_bytes: Callable[[int], None] | None = None) -> None:
        """Fill `asm` from the bulk port (`on_bytes(n)` as bytes land: the node's progress
        lines). BulkUnreachable: fall back (already recorded); bulk.RefusedError / OSError /
        TimeoutError: ask for the task again; codec errors: the payload is damaged."""
        try:
            self._resuming(lambda: knock(lambda: bulk.download(
                self.host, port or self.port, self.tls, ticket, asm, idle_s, on_bytes)),
                lambda: asm.received)
        except bulk.BulkUnreachable as exc:
            self.fall_back(str(exc))
            raise
        except (OSError, bulk.BulkProtocolError) as exc:
            self._broke(exc)
            raise
        self._broken = 0

    def upload(self, ticket: str, port: int, payload: Path | Sequence[memoryview],
               idle_s: float = 60.0, on_bytes: Callable[[int], None] | None = None) -> str:
        """Send an update's payload (`on_bytes(n)` as it is handed to the socket); the
        aggregator's message. BulkRpcError: its refusal, or UNAVAILABLE when the connection
        broke (send again); BulkUnreachable: fall back."""
        # The bytes handed to the socket, over all attempts: what tells a connection that
        # moved bytes from one that moved none (the pause before the next resume). Counting
        # makes send_payload hand the payload over in PROGRESS_BYTES pieces, as it always did
        # for the agent (its progress lines): a call per MiB, nothing measurable.
        handed = [0]

        def counted(n: int) -> None:
            handed[0] += n
            if on_bytes is not None:
                on_bytes(n)

        try:
            # Whether the aggregator kept any of it is its to say (the go-ahead's offset):
            # every break is worth one more knock on the same ticket.
            status = self._resuming(lambda: knock(lambda: bulk.upload(
                self.host, port or self.port, self.tls, ticket, payload, idle_s,
                on_bytes=counted)),
                lambda: handed[0], always=True)
        except bulk.BulkUnreachable as exc:
            self.fall_back(str(exc))
            raise
        except (OSError, bulk.BulkProtocolError) as exc:
            self._broke(exc)
            raise BulkRpcError(grpc.StatusCode.UNAVAILABLE,
                               f"bulk upload broke off: {exc}") from None
        self._broken = 0
        if not status.ok:
            raise BulkRpcError.of(status)
        return status.message
