"""The global model as nodes download it: encoded and hashed once per model, shared by every
node's stream, on either path (gRPC chunks or the bulk port).

Backed by the checkpoint file the model was just written to, when there is one: the bytes are
already on disk in wire format, so a download reads them from the page cache (`os.sendfile` on
a plain bulk connection: no copy through the process at all) instead of holding a second,
chunked copy of a multi-GB model in the aggregator's memory. The open descriptor keeps the
file readable while the checkpointer renames a newer model over it. Without a checkpoint
(tests, a wire dtype other than the model's), it is the encoded arrays in memory.
"""

from __future__ import annotations

import os
import socket
import ssl
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedgpu.core import codec, segment_hasher

# Bytes per send from a file on a TLS socket (sendfile cannot encrypt).
SEND_BLOCK = 4 << 20
# A job's wire_dtype: what float32 tensors travel as (both ways), by codec dtype name.
WIRE_DTYPES = {"bf16": "BF16", "fp16": "F16"}


def to_wire(weights: Mapping[str, np.ndarray], wire_dtype: str | None) -> dict[str, np.ndarray]:
    """The global model as nodes receive it: float32 tensors in the job's wire_dtype (float16
    clipped to its range, so a large weight arrives as the largest float16, not infinity)."""
    if wire_dtype is None:
        return dict(weights)
    target = codec.DTYPES[WIRE_DTYPES[wire_dtype]]
    out: dict[str, np.ndarray] = {}
    for name, arr in weights.items():
        if arr.dtype != np.float32:
            out[name] = arr
            continue
        if target == np.float16:
            top = float(np.finfo(np.float16).max)
            arr = np.clip(arr, -top, top)
        out[name] = arr.astype(target)
    return out


def wire_spec(spec: Mapping[str, tuple[str, tuple[int, ...]]] | None, wire_dtype: str | None
              ) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """What a training update must match when float32 travels as `wire_dtype`."""
    if spec is None or wire_dtype is None:
        return dict(spec) if spec is not None else None
    return {k: (WIRE_DTYPES[wire_dtype] if dt == "F32" else dt, shape)
            for k, (dt, shape) in spec.items()}


@dataclass(eq=False)
class ModelPayload:
    size: int
    digest: str
    algorithm: codec.DigestAlgo
    _fd: int | None = None
    _segments: tuple[memoryview, ...] = ()
    _finalizer: weakref.finalize | None = field(default=None, repr=False)
    _segment_digests: bytes | None = None

    def segment_digests(self) -> bytes:
        """What the task header announces of the payload's segments (fedgpu/core/segments.py):
        known from the pass that made its digest (BLAKE3_SEGMENTS: codec.encode, the checkpoint);
        else hashed once per model, at its first task."""
        if self._segment_digests is None:
            _, self._segment_digests = (
                segment_hasher.of_views(self._segments) if self._fd is None
                else segment_hasher.of_file(self._fd))
        return self._segment_digests

    @classmethod
    def from_file(cls, path: Path, digest: str, algorithm: codec.DigestAlgo,
                  segment_digests: bytes | None = None) -> ModelPayload:
        """`segment_digests`: as announced, when the pass that made `digest` gave them."""
        fd = os.open(path, os.O_RDONLY)
        payload = cls(os.fstat(fd).st_size, digest, algorithm, fd,
                      _segment_digests=segment_digests)
        # Closed when the last download of this model lets go of it, not when a newer model
        # replaces it in the engine.
        payload._finalizer = weakref.finalize(payload, os.close, fd)
        return payload

    @classmethod
    def from_encoded(cls, enc: codec.Encoded) -> ModelPayload:
        assert enc.algorithm is not None, "a payload for the wire carries a digest"
        known = enc.algorithm is codec.DigestAlgo.BLAKE3_SEGMENTS
        return cls(enc.size, enc.digest, enc.algorithm, None, enc.segments,
                   _segment_digests=enc.segment_digests if known else None)

    def chunks(self, chunk_size: int, offset: int = 0) -> Iterator[bytes]:
        """The payload in gRPC chunks from byte `offset` on (a resumed stream), read as the
        stream asks for them."""
        if self._fd is None:
            if not offset:
                yield from codec.iter_chunks(codec.Encoded(self._segments, self.size,
                                                           self.digest, self.algorithm),
                                             chunk_size)
                return
            for seg in self._segments:
                if offset >= len(seg):
                    offset -= len(seg)
                    continue
                for pos in range(offset, len(seg), chunk_size):
                    yield bytes(seg[pos : pos + chunk_size])
                offset = 0
            return
        for pos in range(offset, self.size, chunk_size):
            # A pread of the page cache: far below a millisecond per MiB, fine on the loop.
            chunk = os.pread(self._fd, min(chunk_size, self.size - pos), pos)
            if not chunk:
                raise OSError(f"model file shorter than its {self.size} bytes")
            yield chunk

    def send(self, sock: socket.socket, offset: int = 0,
             sent: Callable[[int], None] | None = None) -> None:
        """Write the payload from byte `offset` on (a resumed download) to a connected
        (blocking, timed) socket; `sent(n)` after each block of at most SEND_BLOCK bytes
        (a download's progress, server/transfer/downloads.py)."""
        tell = sent or (lambda n: None)
        if self._fd is None:
            for seg in self._segments:
                if offset >= len(seg):
                    offset -= len(seg)
                    continue
                for pos in range(offset, len(seg), SEND_BLOCK):
                    block = seg[pos : pos + SEND_BLOCK]
                    sock.sendall(block)
                    tell(len(block))
                offset = 0
            return
        if not isinstance(sock, ssl.SSLSocket):
            # socket.sendfile: os.sendfile with the socket's timeout honoured; in blocks, so
            # that progress is counted as it goes (a syscall per 4 MiB costs nothing).
            while offset < self.size:
                n = sock.sendfile(_Descriptor(self._fd), offset,
                                  min(SEND_BLOCK, self.size - offset))
                if n <= 0:
                    raise OSError(f"model file shorter than its {self.size} bytes")
                offset += n
                tell(n)
            return
        buf = bytearray(min(SEND_BLOCK, max(self.size - offset, 1)))
        view = memoryview(buf)
        while offset < self.size:
            n = os.preadv(self._fd, [view[: min(len(buf), self.size - offset)]], offset)
            if n <= 0:
                raise OSError(f"model file shorter than its {self.size} bytes")
            sock.sendall(view[:n])
            offset += n
            tell(n)


class _Descriptor:
    """An open descriptor as socket.sendfile wants a file: shared by concurrent downloads,
    which each pass their own offset (no seek, so no shared file position)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd
