"""The node's side of the wire: register, long-poll, stream updates, heartbeat.

Weights move over the aggregator's bulk port when it has one (node/bulk_client.py) and over
gRPC streaming otherwise, or when that port cannot be reached."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import grpc

from fedgpu.core import bulk, codec, digests
from fedgpu.core.tls import TlsFiles
from fedgpu.core.transport import channel, token_metadata
from fedgpu.node.bulk_client import BulkPath
from fedgpu.proto import pb, pb_grpc


class PayloadError(Exception):
    """A task payload the node cannot use. `header` is the task's, when it arrived: then the
    node reports the task as failed (asking again would bring the same payload); without one
    the stream broke before saying what it carried, and the node asks again."""

    def __init__(self, message: str, header: pb.TaskHeader | None = None) -> None:
        super().__init__(message)
        self.header = header


class PayloadTooLarge(PayloadError):
    """The task announced more bytes than this node takes; nothing of it was read."""


class AggregatorClient:
    def __init__(self, address: str, token: str | None, chunk_size: int = codec.DEFAULT_CHUNK_SIZE,
                 tls: TlsFiles | None = None):
        self.address = address
        self.chunk_size = chunk_size
        self._metadata = token_metadata(token)
        self._channel = channel(address, tls)
        self._stub = pb_grpc.FederationStub(self._channel)
        self.bulk = BulkPath(address, tls)

    def close(self) -> None:
        self._channel.close()

    def register(self, request: pb.RegisterRequest, timeout: float = 10) -> pb.RegisterReply:
        reply = self._stub.Register(request, metadata=self._metadata, timeout=timeout)
        self.bulk.reset(reply.bulk_port)
        return reply

    def heartbeat(self, request: pb.HeartbeatRequest, timeout: float = 10) -> pb.HeartbeatReply:
        return self._stub.Heartbeat(request, metadata=self._metadata, timeout=timeout)

    def pull(self, node_id: str, wait_s: int, max_bytes: int
             ) -> tuple[pb.TaskHeader, memoryview | None]:
        use_bulk = self.bulk.usable
        header, payload = self._pull(node_id, wait_s, max_bytes, use_bulk)
        if not header.HasField("bulk"):
            return header, payload
        asm = _assembler(header, max_bytes)
        try:
            self.bulk.download(header.bulk.ticket, header.bulk.port, asm)
            return header, asm.finish()
        except bulk.BulkUnreachable:
            # The same task again, its payload over gRPC this time (already in the log).
            return self._pull(node_id, 0, max_bytes, False)
        except codec.CodecError as exc:
            raise PayloadError(str(exc), header) from None
        except (OSError, bulk.BulkProtocolError, bulk.RefusedError) as exc:
            # Broken off, or the ticket went stale: ask again (the agent retries this).
            raise PayloadError(f"bulk download failed: {exc}") from None

    def _pull(self, node_id: str, wait_s: int, max_bytes: int, use_bulk: bool
              ) -> tuple[pb.TaskHeader, memoryview | None]:
        stream = self._stub.PullTask(
            pb.PullTaskRequest(node_id=node_id, wait_s=wait_s, bulk=use_bulk,
                               bulk_error=self.bulk.error or ""),
            metadata=self._metadata,
            # The server holds the poll up to wait_s, then the payload may take a while.
            timeout=wait_s + 600,
        )
        header: pb.TaskHeader | None = None
        asm: codec.Assembler | None = None
        try:
            for msg in stream:
                if msg.HasField("header"):
                    header = msg.header
                    if header.payload_size > max_bytes:
                        # Checked here, before anything is allocated, and told apart from
                        # damage: the same task would come back just as large.
                        stream.cancel()
                        raise PayloadTooLarge(
                            f"{header.payload_size} bytes exceed this node's limit of "
                            f"{max_bytes} bytes", header)
                    if header.payload_size and not header.HasField("bulk"):
                        asm = _assembler(header, max_bytes)
                elif asm is not None:
                    asm.add(msg.data)
                else:
                    raise PayloadError("weight chunk before the task header")
            if header is None:
                raise PayloadError("task stream ended without a header")
            return header, asm.finish() if asm is not None else None
        except codec.CodecError as exc:
            stream.cancel()
            raise PayloadError(str(exc), header) from None

    def fetch_bundle(self, node_id: str, sha256: str, max_bytes: int, timeout: float = 120
                     ) -> bytes:
        """A task bundle's bytes, whole and matching `sha256`; PayloadError otherwise."""
        stream = self._stub.FetchBundle(pb.FetchBundleRequest(node_id=node_id, sha256=sha256),
                                        metadata=self._metadata, timeout=timeout)
        header: pb.TaskBundle | None = None
        data = bytearray()
        try:
            for msg in stream:
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
            stream.cancel()
            raise
        if header is None or len(data) != header.size:
            raise PayloadError(f"bundle {sha256[:12]}: the stream ended early")
        if hashlib.sha256(data).hexdigest() != sha256:
            raise PayloadError(f"bundle {sha256[:12]} arrived damaged (digest mismatch)")
        return bytes(data)

    def push(self, header: pb.UpdateHeader, payload: Path | None) -> pb.PushReply:
        if payload is not None:
            digests.stamp(header, codec.WIRE_DIGEST, codec.digest_file(payload, codec.WIRE_DIGEST))
            header.payload_size = payload.stat().st_size
            if self.bulk.usable and header.payload_size:
                ticket = self._stub.OpenUpload(header, metadata=self._metadata, timeout=60)
                try:
                    message = self.bulk.upload(ticket.ticket, ticket.port, payload)
                    return pb.PushReply(accepted=True, message=message)
                except bulk.BulkUnreachable:
                    pass  # over gRPC below, from now on (the log says so once)
        return self._stub.PushUpdate(
            self._update_stream(header, payload), metadata=self._metadata, timeout=3600
        )

    def _update_stream(self, header: pb.UpdateHeader, payload: Path | None
                       ) -> Iterator[pb.UpdateChunk]:
        yield pb.UpdateChunk(header=header)
        if payload is None:
            return
        # Read from disk chunk by chunk: the node never holds a second copy of the model.
        with open(payload, "rb") as fh:
            while chunk := fh.read(self.chunk_size):
                yield pb.UpdateChunk(data=chunk)


def _assembler(header: pb.TaskHeader, max_bytes: int) -> codec.Assembler:
    try:
        algo, digest = digests.of_header(header)
    except digests.UnknownDigest as exc:
        raise codec.CodecError(str(exc)) from None
    return codec.Assembler(header.payload_size, digest, max_bytes, algo)


def is_unreachable(exc: BaseException) -> bool:
    """An RPC error that another try may not have: the aggregator is down or unreachable."""
    return isinstance(exc, grpc.RpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
