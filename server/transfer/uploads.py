"""Receiving update payloads without letting slow or silent senders hold the aggregator.

Every upload has an idle timeout (no chunk for `idle_s`) and an overall deadline (its round's
deadline: after that the update would be late anyway). Memory is claimed against a global
budget when the first payload bytes arrive, not when a header announces a size: a stream that
sends a header and then nothing holds no memory and no slot, and the buffer itself only takes
pages as bytes land in it (codec.Assembler). Who may upload at all (a node selected for the
open round, one stream per node) is the round engine's slot claim, checked before this.

Both paths come through here: gRPC chunks (`receive`) and the bulk port (`receive_socket`,
whose node waits for a go-ahead sent once the memory is reserved, then streams the bytes
straight into the buffer). Either yields the payload and `seconds`, first to last byte.

A bulk upload whose connection breaks is parked, not dropped: its buffer (up to the end of its
last verified segment, fedgpu/core/segments.py) and its memory reservation are kept under its
ticket for RESUME_TTL_S, so the node's resume continues from there. Parked bytes count against the
upload memory budget like any upload in flight, and are let go when the ticket's resume time
runs out or the round no longer wants the update (closed, aborted, its job stopped). The
resumed payload is checked against the header's digest like any other.

An update larger than the whole memory budget goes to disk (server/transfer/spool.py) instead
of being held in memory past the budget: only its two write buffers count against the budget,
and it is folded from its file tensor by tensor. Nothing within the budget ever spills.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fedgpu.core import bulk, codec, digests
from fedgpu.core.buffers import BufferPool
from fedgpu.core.bulk import RESUME_TTL_S
from fedgpu.proto import pb
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.transfer.budget import ByteBudget
from fedgpu.server.transfer.spool import Spool, SpoolFile

DEFAULT_IDLE_S = 60.0
DEFAULT_BUDGET_BYTES = 4 << 30
# An upload in flight that received nothing for this long shows as stalled in `status`.
STALLED_AFTER_S = 5.0
# How often a parked upload's round is asked whether it still wants the upload.
WATCH_S = 2.0


@dataclass
class _Upload:
    node: str
    started: float
    last_byte: float
    received: int = 0
    waiting_for_memory: bool = False
    # perf_counter() when receiving began, when the last byte came, and time spent waiting
    # for upload memory (which is not transfer time).
    began: float = field(default_factory=time.perf_counter)
    last_perf: float = 0.0
    waited: float = 0.0
    size: int = 0  # the payload's announced size (progress in `fedgpu rounds`)

    def got(self, n: int) -> None:
        self.received += n
        self.last_byte = time.time()
        self.last_perf = time.perf_counter()

    @property
    def seconds(self) -> float:
        """Receiving time: from the header (gRPC) or the go-ahead (bulk) to the last byte,
        less any wait for upload memory."""
        end = self.last_perf or time.perf_counter()
        return round(max(end - self.began - self.waited, 0.0), 6)


@dataclass
class Received:
    payload: memoryview
    seconds: float
    # The payload's file when it was spilled to disk (its pages let go tensor by tensor).
    spooled: SpoolFile | None = None
    finite: codec.FiniteResult | None = None  # its finite check, taken as the bytes landed


@dataclass
class _Parked:
    """A broken bulk upload's bytes, kept for its ticket's resume."""

    up: _Upload
    asm: codec.Assembler | SpoolFile
    reserved: int
    expiry: asyncio.TimerHandle | None = None
    # The task it answers, asked about every WATCH_S while parked (Uploads.wanted).
    node_id: str = ""
    task_id: str = ""


# Runs a blocking call (a socket read) on the bulk path's own threads.
Blocking = Callable[..., Awaitable[Any]]


@dataclass
class Uploads:
    max_update_bytes: int
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    idle_s: float = DEFAULT_IDLE_S
    timed_out: int = 0
    _active: dict[int, _Upload] = field(default_factory=dict)
    _budget: ByteBudget | None = None
    _pool: BufferPool = field(init=False)
    # The bulk port's figures (server/transfer/bulk_server.py), shown beside these; None: no
    # bulk port.
    bulk: Callable[[], dict[str, Any]] | None = None
    resume_ttl_s: float = RESUME_TTL_S
    # Broken bulk uploads kept for their resume, by ticket; how many resumed and expired.
    _parked: dict[str, _Parked] = field(default_factory=dict)
    resumed: int = 0
    expired: int = 0
    # Where updates larger than the whole budget go (None: held in memory past the budget).
    spool: Spool | None = None
    # Whether a node's task is still wanted by its open round (node_id, task_id), as the
    # heartbeat asks (server/jobs/queue.py wants); None: parked uploads wait out their TTL.
    wanted: Callable[[str, str], bool] | None = None

    def __post_init__(self) -> None:
        self._budget = ByteBudget(self.budget_bytes)
        # Buffers of finished uploads, kept warm for the next update of the same model
        # (fedgpu.core.buffers): within the budget, let go when unused for a while.
        self._pool = BufferPool(self.budget_bytes)

    async def next_message(self, stream: AsyncIterator[pb.UpdateChunk], deadline: float
                           ) -> pb.UpdateChunk | None:
        """The stream's next message, None at its end; UpdateRejected(timeout) when the sender
        is silent for idle_s or the deadline passes."""
        now = time.time()
        wait = min(self.idle_s, deadline - now)
        try:
            return await asyncio.wait_for(anext(stream), timeout=max(wait, 0.0))
        except StopAsyncIteration:
            return None
        except TimeoutError:
            self.timed_out += 1
            if deadline - now <= self.idle_s:
                raise UpdateRejected(Reject.TIMEOUT, "the upload did not finish by the round's "
                                     "deadline") from None
            raise UpdateRejected(Reject.TIMEOUT, f"no data for {self.idle_s:g}s: the upload "
                                 "stalled (--upload-idle-s)") from None

    @contextlib.asynccontextmanager
    async def _upload(self, node: str, header: pb.UpdateHeader, resume_key: str | None = None,
                      park_on_cancel: bool = False
                      ) -> AsyncIterator[tuple[_Upload, codec.Assembler | SpoolFile,
                                               list[int]]]:
        """One upload's bookkeeping on either path: listed in `stats` while it runs, its
        buffer back to the pool and its reserved memory (the list's one entry, set by the
        path once reserved) released when the caller's block is over, unless the block
        parked them for a resume (the list's entry set back to 0)."""
        assert self._budget is not None
        parked = self._parked.pop(resume_key, None) if resume_key is not None else None
        if parked is not None:
            if parked.expiry is not None:
                parked.expiry.cancel()
            self.resumed += 1
            up, asm, reserved = parked.up, parked.asm, [parked.reserved]
            up.last_byte = time.time()
        else:
            asm = self._sink(header)
            now = time.time()
            up = _Upload(node, now, now, size=header.payload_size)
            reserved = [0]
        self._active[id(up)] = up
        kept = [False]
        try:
            yield up, asm, reserved
        except (OSError, codec.Truncated, asyncio.CancelledError, UpdateRejected) as exc:
            # A gRPC stream whose connection broke ends early (truncated) or is cancelled (its
            # node's retry took over); a bulk read is never cancelled mid-read (its socket is
            # shut down first), only at shutdown.
            if isinstance(exc, UpdateRejected):
                breaks = exc.reason == Reject.TRUNCATED
            else:
                breaks = park_on_cancel or not isinstance(exc, asyncio.CancelledError)
            if (breaks and resume_key is not None and reserved[0]
                    and 0 < asm.rewind() < asm.size):
                self._park(resume_key, _Parked(up, asm, reserved[0], node_id=header.node_id,
                                               task_id=header.task_id))
                kept[0] = True
            raise
        finally:
            self._active.pop(id(up), None)
            if not kept[0]:
                # Nothing views the payload any more: the buffer goes back to the pool.
                asm.release()
                if reserved[0]:
                    self._budget.release(reserved[0])

    def _park(self, key: str, parked: _Parked) -> None:
        parked.expiry = asyncio.get_running_loop().call_later(
            self.resume_ttl_s, self._expire, key, parked)
        self._parked[key] = parked
        self._watch(key, parked, time.monotonic() + self.resume_ttl_s)

    def _watch(self, key: str, parked: _Parked, until: float) -> None:
        """Let `parked` go as soon as its round no longer wants its task (closed, aborted,
        its job stopped): a resume would be refused anyway, and a spilled one's file goes."""
        if self._parked.get(key) is not parked or time.monotonic() >= until:
            return
        if self.wanted is not None and not self.wanted(parked.node_id, parked.task_id):
            self.expired += 1
            self._drop(key)
            return
        asyncio.get_running_loop().call_later(WATCH_S, self._watch, key, parked, until)

    def _expire(self, key: str, parked: _Parked) -> None:
        """A parked upload nobody resumed in time: its memory goes back to the budget."""
        if self._parked.get(key) is not parked:
            return
        self.expired += 1
        self._drop(key)

    def _drop(self, key: str) -> None:
        parked = self._parked.pop(key)
        if parked.expiry is not None:
            parked.expiry.cancel()
        parked.asm.release()
        assert self._budget is not None
        self._budget.release(parked.reserved)

    def close(self) -> None:
        """At shutdown: what parked uploads kept is let go (a spilled one's file too)."""
        for key in list(self._parked):
            self._drop(key)

    def _received(self, up: _Upload, asm: codec.Assembler | SpoolFile) -> Received:
        """The checked payload; the upload is no longer listed as in flight (what follows,
        decode and aggregation, is not receiving)."""
        try:
            payload = asm.finish()
        except codec.CodecError as exc:
            # The codec says which defect it was (too_large, digest, truncated, malformed).
            raise UpdateRejected(Reject(exc.reason), str(exc)) from None
        self._active.pop(id(up), None)
        if isinstance(asm, SpoolFile):
            return Received(payload, up.seconds, asm)
        return Received(payload, up.seconds, finite=asm.finite())

    def quiet_for(self, node: str) -> float:
        """Seconds since `node`'s upload in flight last received a byte; 0 when it has none
        (it may be decoding or folding) or waits for memory (alive, not silent)."""
        now = time.time()
        quiet = [now - u.last_byte for u in self._active.values()
                 if u.node == node and not u.waiting_for_memory]
        return min(quiet) if quiet else 0.0

    def progress(self) -> dict[str, tuple[int, int, float]]:
        """Uploads in flight by node name: (bytes received, payload size, receiving seconds)
        — a round's progress as `fedgpu rounds` shows it (server/views/round_progress.py)."""
        return {u.node: (u.received, u.size, u.seconds) for u in self._active.values()}

    def parked_offset(self, key: str) -> int:
        """Bytes kept of the broken upload parked under `key` (0: none)."""
        parked = self._parked.get(key)
        return parked.asm.received if parked is not None else 0

    @contextlib.asynccontextmanager
    async def receive(self, node: str, header: pb.UpdateHeader,
                      stream: AsyncIterator[pb.UpdateChunk], deadline: float,
                      resume_key: str | None = None) -> AsyncIterator[Received]:
        """The payload announced by `header`, checked against its size and digest; its memory
        stays reserved until the block using it ends (decode, validation, aggregation). With
        `resume_key`, a stream that breaks is parked under it, and a header whose
        payload_offset is set continues the one parked there. A stream that ends early is
        refused as truncated, and parked too: grpc.aio ends the stream of a connection that
        broke the same way, and the node may resume it."""
        if header.payload_offset and self.parked_offset(resume_key or "") != header.payload_offset:
            raise UpdateRejected(Reject.MALFORMED, f"nothing of this update is kept at offset "
                                 f"{header.payload_offset}: send it from its first byte")
        if not header.payload_offset and resume_key in self._parked:
            # Sent again from its first byte: what was kept of it is let go.
            self._drop(resume_key)
        async with self._upload(node, header, resume_key, park_on_cancel=True) as (
                up, asm, reserved):
            try:
                while True:
                    msg = await self.next_message(stream, deadline)
                    if msg is None:
                        break
                    if msg.HasField("header"):
                        raise UpdateRejected(Reject.MALFORMED,
                                             "a second header inside the stream")
                    if not reserved[0] and msg.data:
                        reserved[0] = await self._reserve(up, asm, deadline)
                    asm.add(msg.data)
                    up.got(len(msg.data))
            except codec.CodecError as exc:
                raise UpdateRejected(Reject(exc.reason), str(exc)) from None
            yield self._received(up, asm)

    @contextlib.asynccontextmanager
    async def receive_socket(self, node: str, header: pb.UpdateHeader, sock: socket.socket,
                             deadline: float, blocking: Blocking, resume_key: str | None = None
                             ) -> AsyncIterator[Received]:
        """The payload `header` announces, read from a bulk connection straight into its
        buffer. The go-ahead goes out once the memory is reserved, naming the bytes already
        held (a resume of the upload parked under `resume_key`); then the same idle
        timeout, deadline, size and digest checks as a gRPC stream. OSError: the connection
        broke (not a verdict on the update; with `resume_key` its bytes are parked)."""
        async with self._upload(node, header, resume_key) as (up, asm, reserved):
            try:
                if not reserved[0]:
                    reserved[0] = await self._reserve(up, asm, deadline)
                await blocking(bulk.write_status, sock, bulk.Status(True, offset=asm.received))
                await blocking(bulk.recv_payload, sock, asm, self.idle_s, deadline, up.got,
                               bulk.MIN_RATE_BPS)
            except bulk.TooSlow as exc:
                self.timed_out += 1
                raise UpdateRejected(Reject.TIMEOUT, f"{exc}: the upload trickled") from None
            except TimeoutError:
                self.timed_out += 1
                if deadline - time.time() <= self.idle_s:
                    raise UpdateRejected(Reject.TIMEOUT, "the upload did not finish by the "
                                         "round's deadline") from None
                raise UpdateRejected(Reject.TIMEOUT, f"no data for {self.idle_s:g}s: the "
                                     "upload stalled (--upload-idle-s)") from None
            except codec.Truncated as exc:
                # The sender closed mid-payload: a broken connection, not a damaged update.
                raise ConnectionError(str(exc)) from None
            except codec.CodecError as exc:
                raise UpdateRejected(Reject(exc.reason), str(exc)) from None
            yield self._received(up, asm)

    def assembler(self, header: pb.UpdateHeader) -> codec.Assembler:
        """The buffer and digest for the payload `header` announces; UpdateRejected if it is
        over the limit or names no digest this version knows."""
        try:
            algo, digest = digests.of_header(header)
            return codec.Assembler(header.payload_size, digest, self.max_update_bytes, algo,
                                   self._pool, header.payload_segment_digests, scan=True)
        except digests.UnknownDigest as exc:
            raise UpdateRejected(Reject.MALFORMED, str(exc)) from None
        except codec.CodecError as exc:
            raise UpdateRejected(Reject(exc.reason), str(exc)) from None

    def _sink(self, header: pb.UpdateHeader) -> codec.Assembler | SpoolFile:
        """Where the payload `header` announces lands: memory, or the spool when it is larger
        than the whole memory budget."""
        asm = self.assembler(header)
        if self.spool is None or not self.spool.wants(asm.size, self.budget_bytes):
            return asm
        return self.spool.file(asm.size, asm.expected, asm.algorithm, asm.segment_digests)

    async def _reserve(self, up: _Upload, asm: codec.Assembler | SpoolFile,
                       deadline: float) -> int:
        # Memory is claimed once bytes arrive: announcing a size costs nothing. A spilled
        # upload holds its room on the disk (given back by asm.release()) and its write
        # buffers in memory.
        assert self._budget is not None
        size = asm.memory if isinstance(asm, SpoolFile) else asm.size
        up.waiting_for_memory = True
        t0 = time.perf_counter()
        try:
            if isinstance(asm, SpoolFile):
                await asm.claim(deadline - time.time())
            await self._budget.acquire(size, deadline - time.time())
        except TimeoutError:
            self.timed_out += 1
            raise UpdateRejected(
                Reject.TIMEOUT, "the aggregator's upload memory (or its spool for updates "
                "larger than that) was in use until the round's deadline "
                "(--upload-memory-mib, --upload-spool-mib)") from None
        finally:
            up.waiting_for_memory = False
            up.waited += time.perf_counter() - t0
        up.last_byte = time.time()
        return size

    def stats(self) -> dict[str, Any]:
        """The `uploads` object of `fedgpu status --json`."""
        assert self._budget is not None
        self._pool.trim()
        now = time.time()
        active = list(self._active.values())
        return {
            "in_flight": len(active),
            "stalled": sum(1 for u in active if not u.waiting_for_memory
                           and now - u.last_byte > STALLED_AFTER_S),
            "waiting_for_memory": sum(1 for u in active if u.waiting_for_memory),
            "timed_out": self.timed_out,
            "memory_reserved_bytes": self._budget.used,
            "memory_budget_bytes": self._budget.total,
            "memory_peak_bytes": self._budget.peak,
            "idle_timeout_s": self.idle_s,
            "parked_for_resume": len(self._parked),
            "resumed": self.resumed,
            "expired_unresumed": self.expired,
            **(self.spool.stats() if self.spool is not None else {}),
        }
