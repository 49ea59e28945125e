"""A payload received only to be checked, never kept: what a simulated node downloads
(`fedgpu sim --update-file`), with the Assembler's interface so the bulk and gRPC receivers
take either."""

from __future__ import annotations

import contextlib

from fedgpu.core import codec
from fedgpu.core.digest_pipe import PIPELINE_MIN_BYTES, PipelinedDigest

# Largest single recv_into: big enough that the per-call cost vanishes, small enough that the
# digest keeps pace block by block.
RECV_BLOCK = 8 << 20


class DigestSink:
    """Receives a payload only to check it: the Assembler's interface over two reused blocks,
    for simulated nodes that must not hold what they download (fedgpu sim --update-file).
    A large payload is hashed a block behind the reads, on a thread of its own: the block
    being hashed is never the one being filled."""

    def __init__(self, size: int, digest: str, algorithm: codec.DigestAlgo,
                 block: int = RECV_BLOCK, segment_digests: bytes = b"") -> None:
        self.size, self.expected, self.algorithm = size, digest.lower(), algorithm
        self.received = 0
        length = min(block, max(size, 1))
        self._bufs = (bytearray(length), bytearray(length) if size > length else bytearray())
        self._cur = 0
        self._fill = 0
        plain = codec.receiving(algorithm, self.expected, segment_digests, size)
        self._segments = plain if codec.resumable(plain) else None
        self._digest: codec.Hasher | PipelinedDigest = (
            PipelinedDigest(plain) if size >= PIPELINE_MIN_BYTES else plain)

    def tail(self) -> memoryview:
        buf = self._bufs[self._cur]
        end = min(len(buf), self._fill + self.size - self.received)
        return memoryview(buf)[self._fill:end]

    def advance(self, n: int) -> None:
        if self.received + n > self.size:
            raise codec.CodecError(f"stream sent more than the announced {self.size} bytes")
        self._fill += n
        self.received += n
        if self._fill == len(self._bufs[self._cur]) or self.received == self.size:
            self._digest.update(memoryview(self._bufs[self._cur])[:self._fill])
            self._cur, self._fill = 1 - self._cur if self._bufs[1] else 0, 0

    def add(self, chunk: bytes) -> None:
        if self.received + len(chunk) > self.size:
            raise codec.CodecError(f"stream sent more than the announced {self.size} bytes")
        self._digest.update(chunk)
        self.received += len(chunk)

    def rewind(self) -> int:
        """As codec.Assembler.rewind: back to the end of the last verified segment."""
        if self._segments is None:
            return self.received
        with contextlib.suppress(codec.CodecError):  # a damaged segment is simply not kept
            if self._fill:
                self._digest.update(memoryview(self._bufs[self._cur])[:self._fill])
                self._cur = 1 - self._cur if self._bufs[1] else 0
            if isinstance(self._digest, PipelinedDigest):
                self._digest.wait()
        self._fill = 0
        self.received = self._segments.rewind()
        return self.received

    def finish(self) -> None:
        codec.check_whole(self.received, self.size, self._digest, self.expected, self.algorithm)
