"""The BLAKE3_SEGMENTS digest: a payload's whole digest derived from its segment digests, so
one hashing pass gives both (issue 37, point 7: segment digests must not cost a second pass).

The rule (DigestAlgorithm DIGEST_ALGORITHM_BLAKE3_SEGMENTS): cut the payload into segments of
segments.segment_bytes(size) (1 MiB from 32 MiB up, smaller below: the size alone decides; the
last may be short), take each segment's 32-byte BLAKE3 digest, and the payload digest is
BLAKE3 of those digests concatenated in order. The empty payload has no segments, so its
digest is BLAKE3 of the empty string. The standard BLAKE3 root cannot be derived from the
segment digests (the binding does not expose chaining values), hence an
algorithm of its own; receivers still take "blake3" and sha256 payloads from older senders.

A header naming BLAKE3_SEGMENTS whose announced segment digests do not hash to its payload
digest is refused before a byte moves (check_root): a receiver checks each segment against
the list, and the list against the digest, so a verified segment is one the whole digest
vouches for too.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import blake3

from fedgpu.core.codec_errors import CodecError
from fedgpu.core.segments import (
    DIGEST_BYTES,
    MAX_SEGMENTS,
    check,
    checked,
    segment_bytes,
)

# Threads hashing a payload's segments at once on the sending side (BLAKE3 releases the GIL
# for inputs this large; the old whole-payload hash used all cores too).
MAX_THREADS = 8
# A received payload's whole segments are hashed a run at a time on this many threads when
# each is at least this large (smaller ones: the per-task overhead would eat the gain).
PARALLEL_MIN_SEGMENT = 256 << 10
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def receive_threads() -> int:
    """Threads that hash one received payload: half the cores, at most MAX_THREADS. One on a
    machine of two or three cores, where the sender, the socket reads and the hash already
    share them (a second hashing thread only competes: BENCHMARKS.md section 18); on a
    16-core aggregator one BLAKE3 thread (2-3 GB/s) would be slower than the loopback socket."""
    return max(1, min(MAX_THREADS, _cores() // 2))


def root(digests: bytes) -> str:
    """The payload digest BLAKE3_SEGMENTS names, from its concatenated segment digests."""
    return blake3.blake3(digests).hexdigest()


def check_root(digests: bytes, expected: str) -> None:
    """A header's announced segment digests must hash to its payload digest; CodecError (a
    malformed header, refused before any byte) otherwise."""
    if digests and root(digests) != expected.lower():
        raise CodecError(
            f"the header's {len(digests) // DIGEST_BYTES} segment digests hash to "
            f"{root(digests)}, not to its payload digest {expected or '(none)'}")


def announced(digests: bytes) -> bytes:
    """What a header announces of a payload's segments: b"" past MAX_SEGMENTS."""
    return digests if len(digests) // DIGEST_BYTES <= MAX_SEGMENTS else b""


class SegmentHasher:
    """The BLAKE3_SEGMENTS digest, fed in pieces (memoryview slices, no copies).

    Given the announced `digests` (and the payload's `size`), each segment is checked as it
    completes: a mismatch names it. `verified` is the end of the last segment that matched;
    rewind() goes back there, so a broken transfer resumes from a verified offset. Without
    announced digests nothing is checked before the end and rewind() keeps every byte.
    """

    def __init__(self, size: int, digests: bytes = b"", threads: int | None = None) -> None:
        self.digests = checked(size, digests) if digests else b""
        self.size = size
        self.seg = segment_bytes(size)
        self.threads = min(MAX_THREADS, threads or receive_threads())
        self.verified = 0
        self._done = bytearray()  # the digests of the completed segments
        self._seg = blake3.blake3(max_threads=1)
        self._fill = 0  # bytes in the open segment
        self._pos = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        pos = 0
        while pos < view.nbytes:
            if self._fill == 0 and self.threads > 1 and self.seg >= PARALLEL_MIN_SEGMENT:
                whole = min(view.nbytes - pos, self.size - self._pos) // self.seg
                if whole > 1:
                    self._whole_segments(view[pos:pos + whole * self.seg])
                    pos += whole * self.seg
                    continue
            take = min(view.nbytes - pos, self.seg - self._fill)
            if self._pos + take > self.size:
                raise CodecError(f"more than the announced {self.size} bytes")
            self._seg.update(view[pos:pos + take])
            pos += take
            self._pos += take
            self._fill += take
            if self._fill == self.seg or self._pos == self.size:
                self._close_segment()

    def _whole_segments(self, view: memoryview) -> None:
        """Whole segments from a segment boundary, hashed on `threads` threads (BLAKE3 lets
        go of the GIL), then checked in order as if they had come one by one."""
        runs = min(self.threads, view.nbytes // self.seg)
        per = -(-(view.nbytes // self.seg) // runs) * self.seg
        pieces = [view[i:i + per] for i in range(0, view.nbytes, per)]
        for digests in _pool(self.threads).map(self._run_digests, pieces):
            for i in range(0, len(digests), DIGEST_BYTES):
                self._pos += self.seg
                self._segment_done(digests[i:i + DIGEST_BYTES])

    def _run_digests(self, run: memoryview) -> bytes:
        return b"".join(_hash([run[i:i + self.seg]]) for i in range(0, run.nbytes, self.seg))

    def _close_segment(self) -> None:
        got = self._seg.digest()
        self._seg = blake3.blake3(max_threads=1)
        self._fill = 0
        self._segment_done(got)

    def _segment_done(self, got: bytes) -> None:
        index = len(self._done) // DIGEST_BYTES
        if self.digests:
            check(self.digests, index, got, self.size, self._pos)
        self._done += got
        self.verified = self._pos

    def rewind(self) -> int:
        """Forget what came after the last verified segment; its end (where to resume).
        Without announced digests nothing is forgotten."""
        if not self.digests:
            return self._pos
        # The verified end is a segment boundary or the payload's end (a short last segment).
        del self._done[-(-self.verified // self.seg) * DIGEST_BYTES:]
        self._seg = blake3.blake3(max_threads=1)
        self._fill = 0
        self._pos = self.verified
        return self.verified

    def segment_digests(self) -> bytes:
        """Every segment's digest so far, the open one's included."""
        return bytes(self._done) + (self._seg.digest() if self._fill else b"")

    def hexdigest(self) -> str:
        return root(self.segment_digests())


def of_views(views: Sequence[memoryview], threads: int | None = None) -> tuple[str, bytes]:
    """(payload digest, segment digests to announce) of a payload laid out as `views`
    (codec.Encoded.segments), hashed in place in one pass: whole segments on a few threads
    at once, on one where there is one core."""
    views = [v if v.ndim == 1 and v.itemsize == 1 else v.cast("B") for v in views]
    seg = segment_bytes(sum(v.nbytes for v in views))
    tasks: list[list[memoryview]] = []
    fill = seg
    for view in views:
        pos = 0
        while pos < view.nbytes:
            if fill == seg:
                tasks.append([])
                fill = 0
            take = min(view.nbytes - pos, seg - fill)
            tasks[-1].append(view[pos:pos + take])
            pos += take
            fill += take
    workers = min(threads or _cores(), MAX_THREADS, len(tasks))
    if workers <= 1:
        digests = b"".join(map(_hash, tasks))
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="fedgpu-segments") as pool:
            digests = b"".join(pool.map(_hash, tasks))
    return root(digests), announced(digests)


def of_file(file: str | os.PathLike[str] | int) -> tuple[str, bytes]:
    """As of_views, for a file's bytes by path or open descriptor (memory-mapped: no copy
    through this process)."""
    if isinstance(file, int):
        return _of_descriptor(file)
    with open(file, "rb") as fh:
        return _of_descriptor(fh.fileno())


def _of_descriptor(fd: int) -> tuple[str, bytes]:
    size = os.fstat(fd).st_size
    if not size:
        return root(b""), b""
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        try:
            return of_views([view])
        finally:
            view.release()


def _hash(pieces: list[memoryview]) -> bytes:
    h = blake3.blake3(max_threads=1)
    for piece in pieces:
        h.update(piece)
    return h.digest()


def _pool(threads: int) -> ThreadPoolExecutor:
    # One pool per size for the process: the aggregator's uploads share it, so the hashing
    # threads stay bounded however many uploads land at once.
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(
                threads, thread_name_prefix="fedgpu-segment-check")
        return pool


def _forget_pools() -> None:
    # A forked child (the node's factory forks round workers) has none of the parent's threads:
    # a pool it inherited would take work that no thread ever does.
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
