"""A spilled update's tensors (server/transfer/spool.py): views of its file's read-only
mapping, validated and folded tensor by tensor, each tensor's pages let go once the next one is
read. Reading a mapped file brings its pages into the process's resident memory; without
letting them go, folding a 2 GiB update from disk would hold 2 GiB of it, as if it had never
left memory. With it, one tensor at a time.

The arrays are the same bytes at the same page offsets as an update received into memory, and
the fold runs the same kernels over them in the same order: the sum is bit-equal to the
in-memory fold (tests/integration/test_spill.py). Letting pages go loses nothing: the file
still has them, and a tensor read again (a strategy reading an update twice) maps them back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np

from fedgpu.server.rounds.validation import check_finite, decode_checked
from fedgpu.server.strategies.aggregate import Normed

# Lets go of the pages of payload bytes [begin, end) (SpoolFile.drop).
Drop = Callable[[int, int], None]


class PagedTensors(Normed):
    """Normed tensors whose pages are let go tensor by tensor as they are read: reading one
    (t[name], items(), values()) lets the previously read one go."""

    def __init__(self, tensors: Mapping[str, np.ndarray], norms: Mapping[str, float],
                 spans: Mapping[str, tuple[int, int]], drop: Drop) -> None:
        super().__init__(tensors, norms)
        self._spans = dict(spans)
        self._drop = drop
        self._current: str | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        arr = super().__getitem__(name)
        if name != self._current:
            if self._current is not None:
                self._drop(*self._spans[self._current])
            self._current = name
        return arr

    def items(self) -> Iterator[tuple[str, np.ndarray]]:  # type: ignore[override]
        return ((k, self[k]) for k in list(self.keys()))

    def values(self) -> Iterator[np.ndarray]:  # type: ignore[override]
        return (self[k] for k in list(self.keys()))


def decode_paged(payload: memoryview, expected: Mapping[str, tuple[str, tuple[int, ...]]] | None,
                 drop: Drop) -> PagedTensors:
    """validation.decode_and_check for a spilled payload: the same checks and norms, one
    tensor's pages in memory at a time."""
    tensors = decode_checked(payload, expected)
    base = _address(np.frombuffer(payload, np.uint8, count=1))
    spans = {}
    for name, arr in tensors.items():
        begin = _address(arr) - base
        spans[name] = (begin, begin + arr.nbytes)
    norms: dict[str, float] = {}
    for name, arr in tensors.items():
        try:
            norms.update(check_finite({name: arr}).norms)
        finally:
            drop(*spans[name])
    return PagedTensors(tensors, norms, spans, drop)


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])
