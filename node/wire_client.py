"""The one client of the Federation wire: register, heartbeat, long-poll for tasks, stream
updates, fetch bundles — over gRPC, with weights over the aggregator's bulk port when it has
one (node/bulk_client.py) and gRPC chunks otherwise or when that port cannot be reached.

Asynchronous (grpc.aio), so one process can hold a thousand of them on one event loop with no
thread each: `fedgpu sim` uses it as it is. The node agent, which is written as threads, uses it
through the blocking facade of node/client.py. A protocol change is written here once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc

from fedgpu.core import bulk, codec, digests, segment_hasher
from fedgpu.core.link_rates import LinkMeter, mbit
from fedgpu.core.tls import TlsFiles
from fedgpu.core.transport import aio_channel, token_metadata
from fedgpu.node.bulk_client import BulkPath
from fedgpu.node.pulled import PayloadError, PayloadTooLarge, Pulled, Receiver, default_receiver
from fedgpu.node.resume_backoff import Progress
from fedgpu.node.transfer_log import TransferLog
from fedgpu.node.update_chunks import payload_chunks
from fedgpu.proto import pb, pb_grpc

log = logging.getLogger("fedgpu.node.link")

# What an update's payload is read from: a file (sent from disk) or an encoded model in memory.
Source = Path | codec.Encoded
# A task stream over gRPC that breaks after some of its payload is asked for again from the
# bytes held, this many times (PullTaskRequest.resume_offset); at once after a stream that
# moved bytes, after a bounded backoff otherwise (node/resume_backoff.py says why).
GRPC_RESUMES = 5
# The gRPC errors of a stream that broke (a reset, a lost connection): worth resuming.
BROKEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


class _Broken(Exception):
    """A task stream that broke with part of its payload received: resumable."""

    def __init__(self, error: grpc.RpcError, header: pb.TaskHeader, asm: Receiver) -> None:
        super().__init__(str(error))
        self.error, self.header, self.asm = error, header, asm


class WireClient:
    """One node's side of the wire. `channel` may be shared by several clients (simulated
    nodes multiplexed on one HTTP/2 connection); a client closes only a channel it opened."""

    def __init__(self, address: str, token: str | None, tls: TlsFiles | None = None,
                 chunk_size: int = codec.DEFAULT_CHUNK_SIZE,
                 channel: grpc.aio.Channel | None = None) -> None:
        self.address = address
        self.chunk_size = chunk_size
        self._metadata = token_metadata(token)
        self._own_channel = channel is None
        self._channel = channel if channel is not None else aio_channel(address, tls)
        self._stub = pb_grpc.FederationStub(self._channel)
        self.bulk = BulkPath(address, tls)
        # Task streams over gRPC resumed after a break.
        self.resumed = 0
        # This node's link rates, measured on every payload it moves, either way and path;
        # sent with every poll and heartbeat (fedgpu/core/link_rates.py).
        self.link = LinkMeter()

    async def close(self) -> None:
        if self._own_channel:
            # Cancels the calls in flight: a long poll ends at once.
            await self._channel.close()

    async def register(self, request: pb.RegisterRequest, timeout: float = 10
                       ) -> pb.RegisterReply:
        reply = await self._stub.Register(request, metadata=self._metadata, timeout=timeout)
        self.bulk.reset(reply.bulk_port)
        if reply.chunk_size:
            self.chunk_size = reply.chunk_size
        return reply

    async def heartbeat(self, request: pb.HeartbeatRequest, timeout: float = 10
                        ) -> pb.HeartbeatReply:
        request.down_bytes_per_s, request.up_bytes_per_s = self.link.down, self.link.up
        return await self._stub.Heartbeat(request, metadata=self._metadata, timeout=timeout)

    async def pull(self, node_id: str, wait_s: int, max_bytes: int,
                   receiver: Callable[[pb.TaskHeader], Receiver] | None = None,
                   busy: Sequence[str] = (), only: str = "") -> Pulled:
        """The next task. PayloadTooLarge / PayloadError with the header: this task cannot be
        used (report it); PayloadError without one, or grpc.RpcError: ask again. `busy`: the
        tasks this node's other slots work on (not served again); `only`: that task or none
        (a secure round's next stage)."""
        make = receiver or (lambda h: default_receiver(h, max_bytes))
        asks = (tuple(busy), only)
        pulled = await self._pull(node_id, wait_s, max_bytes, self.bulk.usable, make, asks)
        header = pulled.header
        if not header.HasField("bulk") or pulled.receiver is None:
            self._measured("down", header.payload_size - header.payload_offset,
                           pulled.seconds, pulled.transport)
            return pulled
        started = time.perf_counter()
        progress = TransferLog("download over bulk", header.payload_size)
        try:
            await asyncio.to_thread(self.bulk.download, header.bulk.ticket, header.bulk.port,
                                    pulled.receiver, on_bytes=progress.add)
            payload = pulled.receiver.finish()
        except bulk.BulkUnreachable:
            _release(pulled.receiver)
            # The same task again, its payload over gRPC this time (already in the log).
            return await self._pull(node_id, 0, max_bytes, False, make, asks)
        except codec.CodecError as exc:
            _release(pulled.receiver)
            raise PayloadError(str(exc), header) from None
        except (OSError, bulk.BulkProtocolError, bulk.RefusedError) as exc:
            _release(pulled.receiver)
            # Broken off, or the ticket went stale: ask again (the agent retries this).
            raise PayloadError(f"bulk download failed: {exc}") from None
        finally:
            progress.end()
        seconds = time.perf_counter() - started
        self._measured("down", header.payload_size, seconds, "bulk")
        return Pulled(header, payload or None, pulled.receiver, "bulk", seconds)

    def _measured(self, way: str, nbytes: int, seconds: float, transport: str) -> None:
        rate = self.link.saw(way, nbytes, seconds)
        if rate is not None:
            # The node's log shows each transfer's rate (and the running figure it reports).
            log.info("%s %d bytes in %.2f s over %s: %s (link %s now ~%s)",
                     "downloaded" if way == "down" else "uploaded", nbytes, seconds,
                     transport, mbit(rate), way, mbit(getattr(self.link, way)))

    async def _pull(self, node_id: str, wait_s: int, max_bytes: int, use_bulk: bool,
                    make: Callable[[pb.TaskHeader], Receiver],
                    asks: tuple[tuple[str, ...], str] = ((), "")) -> Pulled:
        """One task; a gRPC stream that breaks mid-payload is resumed from the bytes held."""
        held: _Broken | None = None
        progress = Progress()
        for tries in range(GRPC_RESUMES + 1):
            try:
                return await self._pull_once(node_id, wait_s if held is None else 0,
                                             max_bytes, use_bulk, make, held, asks)
            except _Broken as broken:
                held = broken
                if tries == GRPC_RESUMES:
                    _release(held.asm)
                    raise held.error from None
                self.resumed += 1
                await asyncio.sleep(progress.pause_after(held.asm.received))
        raise AssertionError("unreachable")

    async def _pull_once(self, node_id: str, wait_s: int, max_bytes: int, use_bulk: bool,
                         make: Callable[[pb.TaskHeader], Receiver], held: _Broken | None,
                         asks: tuple[tuple[str, ...], str] = ((), "")) -> Pulled:
        busy, only = asks
        request = pb.PullTaskRequest(node_id=node_id, wait_s=wait_s, bulk=use_bulk,
                                     bulk_error=self.bulk.error or "",
                                     down_bytes_per_s=self.link.down,
                                     up_bytes_per_s=self.link.up, busy_task_ids=busy,
                                     only_task_id=only)
        if held is not None:
            request.bulk = False
            request.resume_task_id = held.header.task_id
            request.resume_offset = held.asm.rewind()  # the end of its last verified segment
        call = self._stub.PullTask(
            request, metadata=self._metadata,
            # The server holds the poll up to wait_s, then the payload may take a while.
            timeout=wait_s + 600)
        header: pb.TaskHeader | None = None
        asm: Receiver | None = None
        first_byte = 0.0
        progress: TransferLog | None = None
        try:
            async for msg in call:
                if msg.HasField("header"):
                    header = msg.header
                    first_byte = time.perf_counter()
                    progress = TransferLog("download over grpc", header.payload_size,
                                           header.payload_offset)
                    if held is not None:
                        asm, held = self._resumed(header, held), None
                        if asm is not None:
                            continue
                    if header.payload_size > max_bytes:
                        # Checked here, before anything is allocated, and told apart from
                        # damage: the same task would come back just as large.
                        call.cancel()
                        raise PayloadTooLarge(
                            f"{header.payload_size} bytes exceed this node's limit of "
                            f"{max_bytes} bytes", header)
                    if header.payload_size:
                        asm = make(header)
                elif asm is not None and not header.HasField("bulk"):
                    asm.add(msg.data)
                    if progress is not None:
                        progress.add(len(msg.data))
                else:
                    raise PayloadError("weight chunk before the task header")
            if header is None:
                raise PayloadError("task stream ended without a header")
            if header.HasField("bulk"):
                return Pulled(header, None, asm, "bulk", 0.0)
            payload = asm.finish() if asm is not None else None
            return Pulled(header, payload or None, asm, "grpc",
                          time.perf_counter() - first_byte)
        except codec.CodecError as exc:
            call.cancel()
            _release(asm)
            raise PayloadError(str(exc), header) from None
        except grpc.RpcError as exc:
            if (exc.code() in BROKEN and header is not None and asm is not None
                    and 0 < asm.received < asm.size):
                raise _Broken(exc, header, asm) from None
            if held is not None and header is None and exc.code() in BROKEN:
                # The resume found no server (yet): keep the bytes held, try again.
                raise _Broken(exc, held.header, held.asm) from None
            _release(asm)
            _release(held.asm if held is not None else None)
            raise
        except BaseException:
            _release(asm)
            _release(held.asm if held is not None else None)
            raise
        finally:
            if progress is not None:
                progress.end()

    @staticmethod
    def _resumed(header: pb.TaskHeader, held: _Broken) -> Receiver | None:
        """The receiver for the stream that answers a resume: the held one, continued, when the
        stream is the rest of the same payload; a fresh start otherwise (the task changed)."""
        same = (header.task_id == held.header.task_id
                and header.payload_digest == held.header.payload_digest
                and header.payload_size == held.header.payload_size)
        if same and header.payload_offset == held.asm.received:
            return held.asm
        _release(held.asm)
        if header.payload_offset:
            raise PayloadError("a resumed task stream started at an offset this node does "
                               "not hold")
        return None  # another task, sent whole

    async def fetch_bundle(self, node_id: str, sha256: str, max_bytes: int,
                           timeout: float = 120) -> bytes:
        """A task bundle's bytes, whole and matching `sha256`; PayloadError otherwise."""
        call = self._stub.FetchBundle(pb.FetchBundleRequest(node_id=node_id, sha256=sha256),
                                      metadata=self._metadata, timeout=timeout)
        header: pb.TaskBundle | None = None
        data = bytearray()
        try:
            async for msg in call:
                if msg.HasField("header"):
                    header = msg.header
                    if header.sha256 != sha256 or not 0 < header.size <= max_bytes:
                        raise PayloadError(f"bundle header for {header.sha256[:12]} of "
                                           f"{header.size} bytes: not the bundle asked for, "
                                           f"or over this node's limit of {max_bytes} bytes")
                elif header is None:
                    raise PayloadError("bundle bytes before the bundle header")
                else:
                    data += msg.data
                    if len(data) > header.size:
                        raise PayloadError(f"bundle {sha256[:12]}: more bytes than the "
                                           f"{header.size} announced")
        except PayloadError:
            call.cancel()
            raise
        if header is None or len(data) != header.size:
            raise PayloadError(f"bundle {sha256[:12]}: the stream ended early")
        if hashlib.sha256(data).hexdigest() != sha256:
            raise PayloadError(f"bundle {sha256[:12]} arrived damaged (digest mismatch)")
        return bytes(data)

    async def push(self, header: pb.UpdateHeader, source: Source | None
                   ) -> tuple[pb.PushReply, str]:
        """Send an update (and its payload); the aggregator's reply and the path it took.
        The payload's size and digest are stamped on the header unless already there. An
        accepted upload's rate is measured (LinkMeter)."""
        reply, transport, seconds = await self._push(header, source)
        if reply.accepted and seconds is not None:
            self._measured("up", header.payload_size, seconds, transport)
        return reply, transport

    async def _push(self, header: pb.UpdateHeader, source: Source | None
                    ) -> tuple[pb.PushReply, str, float | None]:
        if source is not None:
            # Segment digests (checked as they land) from the pass that made the digest; an
            # Encoded of an older algorithm (not BLAKE3_SEGMENTS) costs a pass of its own.
            if isinstance(source, codec.Encoded):
                header.payload_size, segs = source.size, source.segment_digests
                if not header.payload_digest and source.algorithm is not None:
                    digests.stamp(header, source.algorithm, source.digest)
                if not segs and source.algorithm is not codec.WIRE_DIGEST:
                    _, segs = await asyncio.to_thread(segment_hasher.of_views, source.segments)
            else:
                header.payload_size, segs = source.stat().st_size, b""
                if not header.payload_digest or not header.payload_segment_digests:
                    digest, segs = await asyncio.to_thread(codec.file_digests, source,
                                                           codec.WIRE_DIGEST)
                    if not header.payload_digest:
                        digests.stamp(header, codec.WIRE_DIGEST, digest)
            header.payload_segment_digests = header.payload_segment_digests or segs
            if self.bulk.usable and header.payload_size:
                ticket = await self._stub.OpenUpload(header, metadata=self._metadata,
                                                     timeout=60)
                if ticket.already_accepted:
                    # An earlier try got through; only its acknowledgement was lost.
                    return pb.PushReply(accepted=True, message=ticket.message), "bulk", None
                data = source if isinstance(source, Path) else source.segments
                progress = TransferLog("upload over bulk", header.payload_size)
                try:
                    started = time.perf_counter()
                    message = await asyncio.to_thread(self.bulk.upload, ticket.ticket,
                                                      ticket.port, data,
                                                      on_bytes=progress.add)
                    return (pb.PushReply(accepted=True, message=message), "bulk",
                            time.perf_counter() - started)
                except bulk.BulkUnreachable:
                    pass  # over gRPC below, from now on (the log says so once)
                finally:
                    progress.end()
        started = time.perf_counter()
        reply = await self._push_grpc(header, source)
        return reply, "grpc", time.perf_counter() - started

    async def _push_grpc(self, header: pb.UpdateHeader, source: Source | None
                         ) -> pb.PushReply:
        """PushUpdate; a stream that breaks is resumed from the bytes the aggregator kept
        (UploadOffset), up to GRPC_RESUMES times."""
        progress = Progress()
        for tries in range(GRPC_RESUMES + 1):
            try:
                return await self._stub.PushUpdate(self._chunks(header, source),
                                                   metadata=self._metadata, timeout=3600)
            except grpc.RpcError as exc:
                if (exc.code() not in BROKEN or tries == GRPC_RESUMES or source is None
                        or not header.payload_size):
                    raise
            where = await self._stub.UploadOffset(header, metadata=self._metadata, timeout=60)
            if where.already_accepted:
                return pb.PushReply(accepted=True, message=where.message)
            await asyncio.sleep(progress.pause_after(where.offset))
            header.payload_offset = where.offset if 0 < where.offset < header.payload_size \
                else 0
            self.resumed += 1
        raise AssertionError("unreachable")

    async def _chunks(self, header: pb.UpdateHeader, source: Source | None
                      ) -> AsyncIterator[pb.UpdateChunk]:
        yield pb.UpdateChunk(header=header)
        progress = TransferLog("upload over grpc", header.payload_size, header.payload_offset)
        try:
            for data in payload_chunks(source, header.payload_offset, self.chunk_size):
                yield pb.UpdateChunk(data=data)
                progress.add(len(data))
        finally:
            progress.end()


def _release(receiver: Receiver | None) -> None:
    if isinstance(receiver, codec.Assembler):
        receiver.release()


def is_unreachable(exc: BaseException) -> bool:
    """An RPC error that another try may not have: the aggregator is down or unreachable."""
    return isinstance(exc, grpc.RpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
