"""An update's payload as the gRPC upload stream sends it: chunks from a byte offset on (a
resumed stream), read from the encoded model in memory or mapped from its file on disk."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path

from fedgpu.core import codec


def payload_chunks(source: Path | codec.Encoded | None, offset: int, chunk_size: int
                   ) -> Iterator[bytes]:
    """`source`'s bytes from `offset` on, `chunk_size` at a time (nothing for None)."""
    if isinstance(source, codec.Encoded):
        if not offset:
            yield from codec.iter_chunks(source, chunk_size)
            return
        for seg in source.segments:
            if offset >= seg.nbytes:
                offset -= seg.nbytes
                continue
            for pos in range(offset, seg.nbytes, chunk_size):
                yield seg[pos : pos + chunk_size].tobytes()
            offset = 0
    elif source is not None and source.stat().st_size:
        # Mapped, not read: the node never holds a second copy of the model.
        with open(source, "rb") as fh, mmap.mmap(fh.fileno(), 0,
                                                 access=mmap.ACCESS_READ) as mm:
            for pos in range(offset, len(mm), chunk_size):
                yield mm[pos : pos + chunk_size]
