"""Tensor wire codec: the safetensors format, written and read without copying tensors.

`safetensors.numpy.save/load` copy every tensor into one big bytes object (and back); here the
payload is a list of segments — the header, then memoryviews of the arrays themselves — that are
hashed and cut into chunks directly, and decoding returns `np.frombuffer` views of the received
buffer. The bytes are a valid safetensors file, so any safetensors reader can open them.
Never pickle: only numeric dtypes are accepted.

The digest algorithms are in fedgpu/core/payload_digest.py (the wire's: BLAKE3 over the
BLAKE3 digests of its segments, one pass for both; payloads name their algorithm, so plain
"blake3" and sha256 ones from older senders and checkpoints stay readable). The errors are
in fedgpu/core/codec_errors.py (segments raise them too); callers name them codec.CodecError
and so on, and the digest names codec.DigestAlgo, codec.hasher and so on.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from fedgpu.core.buffers import FRESH, BufferPool
from fedgpu.core.codec_errors import CodecError as CodecError
from fedgpu.core.codec_errors import DigestMismatch as DigestMismatch
from fedgpu.core.codec_errors import PayloadTooLarge
from fedgpu.core.codec_errors import Truncated as Truncated
from fedgpu.core.digest_pipe import PIPELINE_MIN_BYTES, PipelinedDigest
from fedgpu.core.digest_pipe import Hasher as Hasher
from fedgpu.core.finite_scan import FiniteResult, FiniteScan, ScanningDigest
from fedgpu.core.payload_digest import WIRE_DIGEST, DigestAlgo, check_whole, receiving, resumable
from fedgpu.core.payload_digest import digest_file as digest_file
from fedgpu.core.payload_digest import file_digests as file_digests
from fedgpu.core.payload_digest import hasher as hasher
from fedgpu.core.segment_hasher import of_views

DEFAULT_CHUNK_SIZE = 1 << 20
# A socket read into the Assembler is hashed once this many bytes have piled up.
HASH_BLOCK = 1 << 20
# The same with a hashing thread: fewer, larger hand-overs.
PIPE_BLOCK = 4 << 20
# Blocks queued for the hashing thread before a read waits for it (the buffer holds the whole
# payload, so a queued block's bytes stay put): a read that runs ahead for a moment goes on.
PIPE_DEPTH = 4
# The header is JSON we parse before trusting anything; a huge one is an attack, not a model.
MAX_HEADER_BYTES = 100 << 20

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {dt: name for name, dt in DTYPES.items()}


def dtype_name(dtype: np.dtype) -> str:
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    try:
        return _NAMES[dt]
    except KeyError:
        raise CodecError(f"dtype {dt} cannot travel on the wire (numeric dtypes only)") from None


@dataclass(frozen=True)
class Encoded:
    """A payload as segments, ready to hash and chunk without joining."""

    segments: tuple[memoryview, ...]
    size: int
    digest: str
    algorithm: DigestAlgo | None = None
    # What a header announces of its segments (BLAKE3_SEGMENTS: from the pass that made
    # `digest`, so the sender never hashes the payload again).
    segment_digests: bytes = b""

    def to_bytes(self) -> bytes:
        return b"".join(self.segments)


def encode(
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    *,
    digest: DigestAlgo | None = WIRE_DIGEST,
) -> Encoded:
    """Lay tensors out as safetensors segments; `digest=None` skips the digest (local files
    that never cross the wire, such as the aggregator's spill of robust-strategy updates)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    arrays: list[np.ndarray] = []
    offset = 0
    # safetensors readers expect offsets in name order.
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        dt = dtype_name(arr.dtype)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        header[name] = {
            "dtype": dt,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    head = json.dumps(header, separators=(",", ":")).encode()
    # The spec pads the header so tensor data starts 8-byte aligned.
    head += b" " * (-len(head) % 8)
    segments = [memoryview(struct.pack("<Q", len(head)) + head)]
    # Viewing as bytes first: dtypes such as bfloat16 cannot export a buffer themselves.
    segments += [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays if a.nbytes]
    size = sum(s.nbytes for s in segments)
    if digest is None:
        return Encoded(tuple(segments), size, "")
    if digest is DigestAlgo.BLAKE3_SEGMENTS:
        root, announced = of_views(segments)  # the digest and the segments', one pass
        return Encoded(tuple(segments), size, root, digest, announced)
    h = hasher(digest, all_cores=True)
    for seg in segments:
        h.update(seg)
    return Encoded(tuple(segments), size, h.hexdigest(), digest)


def iter_chunks(encoded: Encoded, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Iterator[bytes]:
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    pending: list[memoryview] = []
    pending_len = 0
    for seg in encoded.segments:
        pos = 0
        while pos < seg.nbytes:
            take = min(chunk_size - pending_len, seg.nbytes - pos)
            pending.append(seg[pos : pos + take])
            pending_len += take
            pos += take
            if pending_len == chunk_size:
                yield pending[0].tobytes() if len(pending) == 1 else b"".join(pending)
                pending, pending_len = [], 0
    if pending_len:
        yield b"".join(pending)


def decode(buf: bytes | bytearray | memoryview) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse a payload into arrays that are views of `buf` (read-only when `buf` is bytes)."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < 8:
        raise CodecError(f"payload of {mv.nbytes} bytes is too short for a safetensors header")
    (head_len,) = struct.unpack("<Q", mv[:8])
    if head_len > MAX_HEADER_BYTES or 8 + head_len > mv.nbytes:
        raise CodecError(f"header length {head_len} does not fit a payload of {mv.nbytes} bytes")
    try:
        header = json.loads(bytes(mv[8 : 8 + head_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodecError(f"header is not valid JSON: {exc}") from None
    except RecursionError:
        # Deeply nested JSON is a hostile header, not a model; it must not kill the server.
        raise CodecError("header JSON is nested too deeply") from None
    if not isinstance(header, dict):
        raise CodecError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CodecError("__metadata__ is not an object")
    data = mv[8 + head_len :]
    tensors: dict[str, np.ndarray] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        tensors[name] = _view(name, info, data)
        begin, end = info["data_offsets"]
        spans.append((begin, end, name))
    # Overlapping or gapped tensors mean a forged header: every byte belongs to one tensor.
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise CodecError(f"tensor {name!r} starts at {begin}, expected {pos}")
        pos = end
    if pos != data.nbytes:
        raise CodecError(f"{data.nbytes - pos} trailing bytes after the last tensor")
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def read_file(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """A safetensors file as writable numpy views of one buffer (torch.from_numpy warns on
    read-only memory). Raises OSError if it cannot be read, CodecError if it is not valid."""
    # A bytearray, not bytes: decode() then returns writable views and no copy is made.
    tensors, _ = decode(bytearray(Path(path).read_bytes()))
    return tensors


def _view(name: str, info: object, data: memoryview) -> np.ndarray:
    if not isinstance(info, dict):
        raise CodecError(f"tensor {name!r}: header entry is not an object")
    raw_dtype = info.get("dtype")
    dt = DTYPES.get(raw_dtype) if isinstance(raw_dtype, str) else None
    if dt is None:
        raise CodecError(f"tensor {name!r}: unsupported dtype {info.get('dtype')!r}")
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if not (
        isinstance(shape, list)
        # type() is int, not isinstance: JSON true/false would pass as 1/0 otherwise.
        and all(type(d) is int and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
    ):
        raise CodecError(f"tensor {name!r}: malformed shape or data_offsets")
    begin, end = offsets
    # Python ints, not np.prod: a forged shape of huge dimensions must not overflow into a
    # size that happens to match the data.
    count = math.prod(shape)
    if not 0 <= begin <= end <= data.nbytes or end - begin != count * dt.itemsize:
        raise CodecError(
            f"tensor {name!r}: offsets {offsets} do not match shape {shape} of {dt} "
            f"in {data.nbytes} data bytes"
        )
    try:
        return np.frombuffer(data[begin:end], dtype=dt).reshape(shape)
    except ValueError as exc:  # e.g. more than 64 dimensions, or one beyond numpy's range
        raise CodecError(f"tensor {name!r}: shape {shape} is not usable: {exc}") from None


def spec(tensors: Mapping[str, np.ndarray]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Names, dtypes and shapes: what an update must match to be accepted."""
    return {k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in tensors.items()}


class Assembler:
    """Collects one streamed payload into a single buffer, hashing as it goes.

    The buffer is an anonymous memory map of the announced size: address space only, whose
    pages the kernel provides as the bytes arrive. A sender that announces 4 GiB and then
    stalls costs nothing (a zero-filled bytearray would commit all of it at once), and a
    completed payload is still one contiguous buffer that decode() views without a copy.
    Chunks are copied in with add(); a socket reads straight into tail() and calls advance().
    With `scan`, a large payload's values are checked as its verified blocks are hashed
    (finite(), fedgpu/core/finite_scan.py), so the aggregator has nothing left to read after
    the last byte but the fold.
    """

    def __init__(self, size: int, digest: str, limit: int,
                 algorithm: DigestAlgo = DigestAlgo.SHA256,
                 pool: BufferPool | None = None, segment_digests: bytes = b"",
                 scan: bool = False) -> None:
        if size < 0:
            raise CodecError(f"payload size {size} is negative")
        if size > limit:
            raise PayloadTooLarge(f"payload of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.algorithm = algorithm
        self.expected = digest.lower()
        # The buffer is taken at the first byte, not here: a receiver creates its assembler
        # (the size and digest checks) before it waits for upload memory, and a buffer taken
        # then would be a fresh one while the pooled one is still being read by the update
        # ahead (one model's worth more memory, and page faults, per update in a queue).
        self._pool = (pool or FRESH) if size else None
        self._buf: mmap.mmap | bytearray | None = None if size else bytearray()
        self._pos = 0
        # Bytes up to here are hashed; a socket's small reads are hashed in larger blocks.
        self._hashed = 0
        # With segment digests, each segment is checked as it is hashed (fedgpu.core.segments).
        self.segment_digests = segment_digests
        self._digest = receiving(algorithm, self.expected, segment_digests, size)
        # A large payload read from a socket is hashed on a thread of its own, a block behind
        # the reads (fedgpu/core/digest_pipe.py).
        self._pipe: PipelinedDigest | None = None
        # With it and `scan` (the aggregator's uploads: a node has no use for it), the finite
        # check and norms of each verified block (fedgpu/core/finite_scan.py).
        self._scans = scan
        self._scan: FiniteScan | None = None

    @property
    def received(self) -> int:
        return self._pos

    def _buffer(self) -> mmap.mmap | bytearray:
        if self._buf is None:
            assert self._pool is not None
            self._buf = self._pool.take(self.size)
        return self._buf

    def add(self, chunk: bytes) -> None:
        end = self._pos + len(chunk)
        if end > self.size:
            raise CodecError(f"stream sent more than the announced {self.size} bytes")
        self._buffer()[self._pos : end] = chunk
        (self._pipe or self._digest).update(chunk)
        self._pos = self._hashed = end

    def tail(self) -> memoryview:
        """The part of the buffer not received yet, for socket.recv_into."""
        return memoryview(self._buffer())[self._pos :]

    def advance(self, n: int) -> None:
        """`n` more bytes were written at the start of tail(): hash them in place."""
        end = self._pos + n
        if n < 0 or end > self.size:
            raise CodecError(f"stream sent more than the announced {self.size} bytes")
        self._pos = end
        if self._pipe is None and self.size >= PIPELINE_MIN_BYTES:
            self._pipe = PipelinedDigest(self._scanning(), PIPE_DEPTH)
        block = PIPE_BLOCK if self._pipe is not None else HASH_BLOCK
        if end - self._hashed >= block or end == self.size:
            self._hash_received()

    def _scanning(self) -> Hasher:
        # Only a digest that knows its verified offset (segments): the scan reads no further.
        if not (self._scans and resumable(self._digest)):
            return self._digest
        self._scan = FiniteScan(memoryview(self._buffer()), lambda buf: decode(buf)[0])
        return ScanningDigest(self._digest, self._scan)

    def finite(self) -> FiniteResult | None:
        """After finish(): the finite check and norms taken as the bytes landed; None when
        none was taken (a small payload, chunks from gRPC, an older digest)."""
        return self._scan.result() if self._scan is not None else None

    def _hash_received(self) -> None:
        if self._pos == self._hashed:
            return
        # A view of its own: the hashing thread may still read it after this returns (the
        # bytes stay put: the buffer holds the whole payload and is given back only by
        # release(), which waits for the thread).
        (self._pipe or self._digest).update(memoryview(self._buffer())[self._hashed:self._pos])
        self._hashed = self._pos

    def rewind(self) -> int:
        """A broken transfer: keep only the bytes up to the end of the last verified segment
        (all of them without segment digests); where the transfer resumes."""
        with contextlib.suppress(CodecError):  # a damaged segment is simply not kept
            self._hash_received()
            if self._pipe is not None:
                self._pipe.wait()
        if resumable(self._digest):
            self._pos = self._hashed = self._digest.rewind()
        return self._pos

    def finish(self) -> memoryview:
        """The whole payload, writable (decode() then returns writable arrays)."""
        if self._pos == self.size:
            self._hash_received()
        check_whole(self._pos, self.size, self._pipe or self._digest, self.expected,
                    self.algorithm)
        return memoryview(self._buffer())

    def release(self) -> None:
        """Give the buffer back to its pool: the payload must no longer be in use."""
        if self._pipe is not None:
            self._pipe.close()
        if self._scan is not None:
            self._scan.drop()
        if self._pool is not None and isinstance(self._buf, mmap.mmap) \
                and self._pool is not FRESH:
            self._pool.give(self._buf)
        self._pool = None
        self._buf = bytearray()
