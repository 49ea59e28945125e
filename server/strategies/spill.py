"""Accepted updates spilled to disk as safetensors, read back one slice at a time.

Robust statistics (median, trimmed mean) need every update of a round at once. Holding K
models in memory would make the aggregator's footprint grow with the number of nodes, so
each update goes to a file as it is accepted and the statistic is computed tensor by tensor,
over column slices of K rows sized to a memory budget. Reads use pread into one reused
buffer, not mmap: mapped pages would count towards the process's memory K times over.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from fedgpu.core import codec
from fedgpu.server.strategies.aggregate import acc_dtype, cast_back

Reducer = Callable[[np.ndarray], np.ndarray]
Visitor = Callable[[str, int, np.ndarray], None]


class UpdateSpill:
    def __init__(self, like: Mapping[str, np.ndarray], directory: str | Path | None = None
                 ) -> None:
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix="fedgpu-spill-", dir=directory))
        self._like = {k: (np.dtype(v.dtype), tuple(v.shape)) for k, v in like.items()}
        # Per file: the byte offset of each tensor's data.
        self._files: list[tuple[Path, dict[str, int]]] = []

    @property
    def count(self) -> int:
        return len(self._files)

    def write(self, tensors: Mapping[str, np.ndarray]) -> None:
        path = self.directory / f"update-{len(self._files):06d}.safetensors"
        # In the model's dtypes: updates sent in a half-precision wire_dtype are read back
        # as the model's tensors.
        enc = codec.encode({k: np.asarray(v).astype(self._like[k][0], copy=False)
                            for k, v in tensors.items()}, digest=None)
        with open(path, "wb") as fh:
            for seg in enc.segments:
                fh.write(seg)
        self._files.append((path, _offsets(path)))

    def reduce(self, reducer: Reducer, budget_bytes: int,
               rows: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """reducer((K, n) block in the working dtype) -> (n,) for every tensor, slice by slice;
        `rows`: only those updates (in that order), K = len(rows).

        The block may be reordered by the reducer. Memory beyond the result: one block of at
        most `budget_bytes` (at least one column).
        """
        out: dict[str, np.ndarray] = {}
        for name, blocks in self._tensors(budget_bytes, rows):
            dtype, shape = self._like[name]
            result = np.empty(int(np.prod(shape, dtype=np.int64)), acc_dtype(dtype))
            for start, block in blocks:
                result[start : start + block.shape[1]] = reducer(block)
            out[name] = cast_back(result.reshape(shape), dtype)
        return out

    def scan(self, visit: Visitor, budget_bytes: int) -> None:
        """visit(tensor name, first column, (K, n) block in the working dtype) over every
        update's values, slice by slice: for statistics of whole updates (Krum's distances).
        Memory: one block of at most `budget_bytes` (at least one column)."""
        for name, blocks in self._tensors(budget_bytes, None):
            for start, block in blocks:
                visit(name, start, block)

    def _tensors(self, budget: int, rows: Sequence[int] | None
                 ) -> Iterator[tuple[str, Iterator[tuple[int, np.ndarray]]]]:
        files = self._files if rows is None else [self._files[r] for r in rows]
        if not files:
            raise ValueError("no updates were added")
        fds = [os.open(p, os.O_RDONLY) for p, _ in files]
        try:
            for name, (dtype, shape) in self._like.items():
                yield name, self._blocks(name, dtype, shape, fds, files, budget)
        finally:
            for fd in fds:
                os.close(fd)

    @staticmethod
    def _blocks(name: str, dtype: np.dtype, shape: tuple[int, ...], fds: list[int],
                files: list[tuple[Path, dict[str, int]]], budget: int
                ) -> Iterator[tuple[int, np.ndarray]]:
        k = len(fds)
        work_dt = acc_dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64))
        # A raw buffer in the file's dtype is needed only when it differs from the working one.
        per_column = k * (work_dt.itemsize + (dtype.itemsize if dtype != work_dt else 0))
        cols = max(1, min(size, budget // per_column))
        work = np.empty((k, cols), work_dt)
        raw = work if dtype == work_dt else np.empty((k, cols), dtype)
        for start in range(0, size, cols):
            n = min(cols, size - start)
            for row, (fd, (_, offsets)) in enumerate(zip(fds, files, strict=True)):
                dest = memoryview(raw[row, :n].view(np.uint8))
                got = os.preadv(fd, [dest], offsets[name] + start * dtype.itemsize)
                if got != dest.nbytes:
                    raise OSError(f"spill file of update {row} is truncated")
            block = work[:, :n]
            if raw is not work:
                block[...] = raw[:, :n]
            yield start, block

    def cleanup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        self._files = []


def _offsets(path: Path) -> dict[str, int]:
    with open(path, "rb") as fh:
        (head_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(head_len))
    header.pop("__metadata__", None)
    return {name: 8 + head_len + info["data_offsets"][0] for name, info in header.items()}
