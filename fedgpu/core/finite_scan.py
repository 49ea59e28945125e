"""An update's finite check and norms, taken segment by segment while the rest still arrives.

Why (issue 37, point 7): after an upload's last byte the aggregator used to read the whole
update once more to check that every value is finite (and to learn the norms FedAvg's sum
bounds itself with) before folding it. Done here instead, on the hashing thread right after
each block's BLAKE3 pass (fedgpu/core/digest_pipe.py), it reads bytes the hash has just
brought into the cache, and on a machine with a core to spare it costs no wall time at all:
what is left after the last byte is the fold.

What it may read: only bytes up to the digest's `verified` offset, the end of the last
segment hashed (checked against its announced digest when the header announced them). Those
bytes never change afterwards: a broken transfer rewinds exactly there and resumes after them
(fedgpu/core/segments.py), so a partial sum of squares never covers bytes that are received
again. Whether the bytes are the sender's is still decided by the whole-payload digest at
finish(), before anything uses this scan's result; and the result is only used when it covers
exactly the tensors the final decode finds (server/rounds/validation.py), else the update is
checked the old way after the last byte. A scan that hits anything unexpected (a header it
cannot parse) stops quietly and leaves the check to that same fallback: it never refuses an
update itself, so it cannot refuse one the old check would take.

The arithmetic (one BLAS dot per chunk, confirmed by isfinite when the dot is not finite) is
`squares`, which the after-the-last-byte check uses too: one rule for both.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from fedgpu.core.digest_pipe import Hasher

Decode = Callable[[memoryview], Mapping[str, np.ndarray]]

# Elements per dot product: large enough that the per-call cost vanishes.
CHUNK = 1 << 22


def squares(flat: np.ndarray) -> float | None:
    """The sum of squares of a 1-d floating array (inf when the squares overflow the dtype);
    None when it holds a NaN or Inf. One dot per CHUNK elements: a NaN or Inf makes the dot
    non-finite, and so do squares past the dtype's range, so a non-finite dot is confirmed by
    isfinite before the values are called bad. bfloat16/float16 are summed in float32 chunks
    (isfinite on them is slow or missing)."""
    sq = 0.0
    for start in range(0, flat.size, CHUNK):
        part = flat[start:start + CHUNK]
        if part.dtype.itemsize < 4:
            part = part.astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            got = float(np.dot(part, part))
        if not math.isfinite(got) and not np.isfinite(part).all():
            return None
        sq += got
    return sq


def scanned(dtype: np.dtype, size: int) -> bool:
    """Whether a tensor has values to check: floating and not empty."""
    return dtype.kind not in "iub" and size > 0


@dataclass(frozen=True)
class FiniteResult:
    """A whole payload's scan: its tensors' names in header order, the 2-norm of each
    floating one, and the first (in data order) holding NaN or Inf, if any."""

    names: tuple[str, ...]
    norms: dict[str, float]
    bad: str | None


@dataclass
class _Span:
    name: str
    flat: np.ndarray | None  # None: nothing to check (integers, empty)
    begin: int               # payload offsets
    end: int


class FiniteScan:
    """Scans a payload buffer's tensors as its verified prefix grows (advance)."""

    def __init__(self, payload: memoryview, decode: Decode) -> None:
        # `decode`: codec.decode's tensors (views, reading only the header); passed in so that
        # the codec, which owns the format, can use this module without an import cycle.
        self._decode = decode
        self._payload: memoryview | None = payload
        self._size = payload.nbytes
        self._seen = 0   # the verified prefix so far
        self._spans: list[_Span] | None = None
        self._names: tuple[str, ...] = ()
        self._i = 0      # the span being scanned
        self._done = 0   # payload bytes scanned
        self._sq: dict[str, float] = {}
        self._bad: str | None = None
        self.failed = False

    def advance(self, upto: int) -> None:
        """Scan the payload's bytes up to `upto` (never changed again by the receiver)."""
        if self.failed or self._payload is None:
            return
        self._seen = max(self._seen, upto)
        try:
            if self._spans is None and not self._layout(upto):
                return
            self._scan(upto)
        except Exception:  # noqa: BLE001 - the check after the last byte decides instead
            self.failed = True
            self.drop()

    def _layout(self, upto: int) -> bool:
        """The tensors' places, once the header has arrived; False until it has."""
        assert self._payload is not None
        if upto < 8:
            return False
        (head_len,) = struct.unpack("<Q", self._payload[:8])
        if 8 + head_len > upto:
            return False
        # Views only: decode reads the header, never the data bytes (not all here yet).
        tensors = self._decode(self._payload)
        base = 8 + head_len
        data = np.frombuffer(self._payload, np.uint8, count=1)
        origin = data.__array_interface__["data"][0]
        spans = []
        for name, arr in tensors.items():
            begin = arr.__array_interface__["data"][0] - origin if arr.size else base
            flat = arr.reshape(-1) if scanned(arr.dtype, arr.size) else None
            spans.append(_Span(name, flat, begin, begin + arr.nbytes))
        spans.sort(key=lambda s: (s.begin, s.end))
        self._names = tuple(tensors)
        self._spans = spans
        self._done = base
        return True

    def _scan(self, upto: int) -> None:
        assert self._spans is not None
        while self._i < len(self._spans):
            span = self._spans[self._i]
            if span.flat is None or span.end == span.begin:
                self._done = max(self._done, span.end)
                self._i += 1
                continue
            start = max(self._done, span.begin)
            item = span.flat.itemsize
            count = (min(upto, span.end) - start) // item
            if count <= 0:
                return
            first = (start - span.begin) // item
            if self._bad is None or span.name != self._bad:
                got = squares(span.flat[first:first + count])
                if got is None:
                    self._bad = self._bad or span.name
                else:
                    self._sq[span.name] = self._sq.get(span.name, 0.0) + got
            self._done = start + count * item
            if self._done < span.end:
                return
            self._i += 1

    def result(self) -> FiniteResult | None:
        """The scan of the whole payload; None when it did not cover all of it (stopped, or
        not everything arrived)."""
        if (self.failed or self._spans is None or self._i < len(self._spans)
                or self._seen < self._size):
            return None
        norms = {s.name: math.sqrt(self._sq.get(s.name, 0.0)) for s in self._spans
                 if s.flat is not None and s.end > s.begin and s.name != self._bad}
        return FiniteResult(self._names, norms, self._bad)

    def drop(self) -> None:
        """Let go of the views of the buffer (it goes back to its pool)."""
        self._payload = None
        if self._spans is not None:
            for span in self._spans:
                span.flat = None


class ScanningDigest:
    """A receiving digest whose every update is followed by a scan of the bytes it verified:
    the block the hashing thread just read is checked while it is still in the cache."""

    def __init__(self, digest: Hasher, scan: FiniteScan) -> None:
        self.digest = digest
        self.scan = scan

    def update(self, data: bytes | memoryview, /) -> None:
        self.digest.update(data)
        self.scan.advance(self.digest.verified)  # type: ignore[attr-defined]

    def hexdigest(self) -> str:
        return self.digest.hexdigest()
