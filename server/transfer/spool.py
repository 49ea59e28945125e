"""Updates larger than the upload memory budget, received onto disk instead of into memory.

Without this, an update past `--upload-memory-mib` was granted an oversize reservation and
held whole in memory: three 2 GiB updates under a 1 GiB budget meant 2 GiB of buffer on top
of the running sum, whatever the budget said. Such an update now lands in a file of the spool
(`STATE_DIR/spool`, bounded by `--upload-spool-mib`), written block by block through two small
buffers (counted against the memory budget like any upload's memory) and hashed as it lands.
Once checked, the file is mapped read-only and folded tensor by tensor (server/rounds/paged.py
lets each tensor's pages go once the fold is past it), so memory holds one tensor of it at a
time, never the update.

Threat model: a node (or someone holding a node's token) announcing huge updates to fill the
aggregator's disk. The spool's budget bounds what all spilled uploads hold together, strictly:
an update larger than all of it, or than the disk's free space, is refused as too_large
(RESOURCE_EXHAUSTED) with the reason, and nothing else is touched: other uploads, spilled or
not, go on. One that fits the budget but not what is left of it now waits for room, like an
upload waiting for memory, until its round's deadline. Space is claimed at the first byte (a
header alone costs nothing) and given back when the update was folded or refused, when its
connection broke and its resume time ran out or its round ended, at shutdown, and at start-up
(leftovers of a crash). What a
node can still do: hold its share of the spool for a round's deadline, as it can hold memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
from pathlib import Path

from fedgpu.core import codec
from fedgpu.core.digest_pipe import PIPELINE_MIN_BYTES, PipelinedDigest
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.transfer.budget import ByteBudget

SPOOL_DIR = "spool"
DEFAULT_SPOOL_BYTES = 16 << 30
# Each of a spilled upload's two buffers: one is written to the file and hashed while the
# socket fills the other. Smaller under a small memory budget (a quarter of it each).
SPILL_BLOCK = 4 << 20
_PREFIX = "upload-"


class Spool:
    """The directory spilled uploads land in and the disk they may hold together."""

    def __init__(self, directory: Path, budget_bytes: int, memory_budget: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        # Files of an aggregator that died mid-upload: nobody can resume into them (the
        # budget that held them is gone with the process).
        for leftover in directory.glob(f"{_PREFIX}*"):
            with contextlib.suppress(OSError):
                leftover.unlink()
        self.directory = directory
        self.total = budget_bytes
        self.budget = ByteBudget(budget_bytes, strict=True)
        self.spilled = 0
        self.refused = 0
        self.block = max(min(SPILL_BLOCK, memory_budget // 4), 64 << 10)

    def wants(self, size: int, memory_budget: int) -> bool:
        """Whether an update of `size` bytes goes to disk: one the memory budget cannot hold."""
        return self.total > 0 and size > memory_budget

    def file(self, size: int, digest: str, algorithm: codec.DigestAlgo,
             segment_digests: bytes = b"") -> SpoolFile:
        if size > self.total:
            self.refused += 1
            raise UpdateRejected(Reject.TOO_LARGE, f"update of {size} bytes is larger than "
                                 f"the aggregator's upload memory and its spool for larger "
                                 f"ones ({self.total} bytes, --upload-spool-mib)")
        return SpoolFile(self, size, digest, algorithm, segment_digests)

    async def claim(self, size: int, timeout: float) -> None:
        """Room for `size` bytes, waited for up to `timeout` (TimeoutError); UpdateRejected
        when the disk itself has less free."""
        free = shutil.disk_usage(self.directory).free
        if size > free:
            self.refused += 1
            raise UpdateRejected(Reject.TOO_LARGE, f"the disk under the aggregator's spool "
                                 f"({self.directory}) has {free} bytes free, this update "
                                 f"needs {size}")
        await self.budget.acquire(size, timeout)
        self.spilled += 1

    def release(self, size: int) -> None:
        self.budget.release(size)

    def files(self) -> list[Path]:
        return sorted(self.directory.glob(f"{_PREFIX}*"))

    def stats(self) -> dict[str, int]:
        return {"spilled": self.spilled, "spool_used_bytes": self.budget.used,
                "spool_peak_bytes": self.budget.peak, "spool_budget_bytes": self.total,
                "spool_refused": self.refused}


class SpoolFile:
    """One spilled payload: the codec.Assembler interface (add; tail and advance for socket
    reads; finish; release) over a file instead of a buffer the payload's size."""

    def __init__(self, spool: Spool, size: int, digest: str,
                 algorithm: codec.DigestAlgo, segment_digests: bytes = b"") -> None:
        self.spool = spool
        self.size = size
        self.algorithm = algorithm
        self.expected = digest.lower()
        self.received = 0
        self.memory = 2 * min(spool.block, size)
        self._fd: int | None = None
        self.path: Path | None = None
        self._bufs: tuple[bytearray, bytearray] | None = None
        self._cur = 0
        self._fill = 0  # bytes of the current buffer not yet written out
        plain = codec.receiving(algorithm, self.expected, segment_digests, size)
        self._segments = plain if codec.resumable(plain) else None
        self._digest: codec.Hasher | PipelinedDigest = (
            PipelinedDigest(plain) if size >= PIPELINE_MIN_BYTES else plain)
        self._map: mmap.mmap | None = None

    async def claim(self, timeout: float) -> None:
        """Take the payload's room on disk and open its file (the first byte came)."""
        if self._fd is not None:
            return
        await self.spool.claim(self.size, timeout)
        try:
            fd, name = tempfile.mkstemp(prefix=_PREFIX, dir=self.spool.directory)
        except OSError:
            self.spool.release(self.size)
            raise
        self._fd, self.path = fd, Path(name)
        length = min(self.spool.block, self.size)
        self._bufs = (bytearray(length), bytearray(length))

    def tail(self) -> memoryview:
        """Where the next bytes go (for socket.recv_into): the rest of the current buffer."""
        assert self._bufs is not None, "claim() first"
        buf = self._bufs[self._cur]
        end = min(len(buf), self._fill + self.size - self.received)
        return memoryview(buf)[self._fill:end]

    def advance(self, n: int) -> None:
        if n < 0 or self.received + n > self.size:
            raise codec.CodecError(f"stream sent more than the announced {self.size} bytes")
        assert self._bufs is not None
        self._fill += n
        self.received += n
        if self._fill == len(self._bufs[self._cur]) or self.received == self.size:
            self._flush()

    def add(self, chunk: bytes) -> None:
        if self.received + len(chunk) > self.size:
            raise codec.CodecError(f"stream sent more than the announced {self.size} bytes")
        view = memoryview(chunk)
        while view.nbytes:
            tail = self.tail()
            n = min(tail.nbytes, view.nbytes)
            tail[:n] = view[:n]
            tail.release()
            view = view[n:]
            self.advance(n)

    def _flush(self) -> None:
        assert self._bufs is not None and self._fd is not None
        block = memoryview(self._bufs[self._cur])[:self._fill]
        at = self.received - self._fill
        while block.nbytes:
            n = os.pwrite(self._fd, block, at)
            block, at = block[n:], at + n
        # Hashed (maybe on the digest's thread) while the other buffer fills.
        self._digest.update(memoryview(self._bufs[self._cur])[:self._fill])
        self._cur, self._fill = 1 - self._cur, 0

    def rewind(self) -> int:
        """As codec.Assembler.rewind: back to the end of the last verified segment (the file's
        later bytes are written over by the resume)."""
        if self._segments is None or self._bufs is None:
            return self.received
        with contextlib.suppress(codec.CodecError):  # a damaged segment is simply not kept
            if self._fill:
                self._flush()
            if isinstance(self._digest, PipelinedDigest):
                self._digest.wait()
        self._fill = 0
        self.received = self._segments.rewind()
        return self.received

    def finish(self) -> memoryview:
        """The whole payload, mapped read-only from its file once its digest checks out."""
        codec.check_whole(self.received, self.size, self._digest, self.expected, self.algorithm)
        assert self._fd is not None
        self._bufs = None  # the buffers' memory goes before the fold maps the file
        self._map = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ)
        return memoryview(self._map)

    def drop(self, begin: int, end: int) -> None:
        """Unmap the pages of bytes [begin, end) from this process (a tensor folded): the file
        keeps them, and reading them again maps them back."""
        if self._map is None or end <= begin:
            return
        page = mmap.PAGESIZE
        start = begin // page * page
        with contextlib.suppress(OSError, ValueError):
            self._map.madvise(mmap.MADV_DONTNEED, start, min(end, self.size) - start)

    def release(self) -> None:
        """The file and its room on disk go; nothing may view the payload any more."""
        if isinstance(self._digest, PipelinedDigest):
            self._digest.close()
        if self._map is not None:
            with contextlib.suppress(BufferError):
                # Still viewed somewhere: unmapped when the last view goes.
                self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            assert self.path is not None
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.spool.release(self.size)
        self._bufs = None
