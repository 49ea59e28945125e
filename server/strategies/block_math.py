"""Kernels of the weighted sum, one block of the sum at a time: out = c * x, out += c * x,
a bound on a block's norm, and the clamp to the dtype's range. x is an array or a block source
(fedgpu.core.update_codecs: int8 and top-k updates decoded block by block).

out += c * x is BLAS axpy (scipy's OpenBLAS): one fused pass that reads x and reads and writes
out once. numpy has no fused multiply-add; its w * x into an L2-resident scratch, then the add,
measured 1.6-1.9x the time of axpy on 10 x 11M float32 (BENCHMARKS.md section 12).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

Axpy = Callable[..., np.ndarray]


@functools.cache
def _axpys() -> dict[np.dtype, Axpy]:
    # Imported on first use: scipy.linalg takes ~0.3 s to import, paid by the first sum of a
    # process instead of every aggregator start (scipy itself is already in the image).
    from scipy.linalg import blas

    return {np.dtype(np.float32): blas.saxpy, np.dtype(np.float64): blas.daxpy}


@functools.cache
def _blas_controller() -> Any:
    from threadpoolctl import ThreadpoolController

    # The controller sees the BLAS libraries loaded when it is made: scipy's OpenBLAS (a
    # library apart from numpy's) must be loaded first, or its threads are left unlimited.
    _axpys()
    return ThreadpoolController()


_limit_lock = threading.Lock()
_limit_users = 0
_limiter: Any = None


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """BLAS on one thread while a sum runs. OpenBLAS splits an axpy over 10k values across
    every core; with the aggregator's other threads (receive, digest, decode) and other
    processes on the same cores, its spinning workers made one 11M-value update 2-10x slower
    than one thread (measured on 2 shared vCPUs), and one thread already reads memory at the
    speed of a plain add. The limit is process-wide (that is how OpenBLAS keeps it): the first
    of concurrent sums sets it and the last one restores the previous setting."""
    global _limit_users, _limiter
    with _limit_lock:
        if _limit_users == 0:
            _limiter = _blas_controller().limit(limits=1, user_api="blas")
        _limit_users += 1
    try:
        yield
    finally:
        with _limit_lock:
            _limit_users -= 1
            if _limit_users == 0:
                _limiter.restore_original_limits()
                _limiter = None


def axpy(src: np.ndarray, c: float, out: np.ndarray, tmp: np.ndarray) -> None:
    """out += c * src for arrays of the same length; tmp: scratch of that length (used only
    when no BLAS routine fits, e.g. float16 inputs into a float32 sum)."""
    fn = _axpys().get(out.dtype) if src.dtype == out.dtype else None
    if fn is None:
        np.multiply(src, c, out=tmp, dtype=out.dtype, casting="unsafe")
        np.add(out, tmp, out=out)
        return
    got = fn(src, out, a=c)
    if got is not out:  # f2py copies an array it cannot update in place: write it back
        np.copyto(out, got)


def write(x: Any, c: float, start: int, stop: int, out: np.ndarray) -> np.ndarray:
    """out = c * x[start:stop]; x an array or a block source (int8, top-k)."""
    if isinstance(x, np.ndarray):
        src = x.reshape(-1)[start:stop]
        if c == 1.0:
            np.copyto(out, src, casting="unsafe")
        else:
            np.multiply(src, c, out=out, dtype=out.dtype, casting="unsafe")
    else:
        x.write_scaled(start, stop, c, out)
    return out


def sum_into(xs: Sequence[Any], cs: Sequence[float], start: int, stop: int,
             out: np.ndarray, tmp: np.ndarray) -> None:
    """out = sum c_i * x_i[start:stop]."""
    write(xs[0], cs[0], start, stop, out)
    fold(xs[1:], cs[1:], start, stop, out, tmp)


def fold(xs: Sequence[Any], cs: Sequence[float], start: int, stop: int,
         out: np.ndarray, tmp: np.ndarray) -> None:
    """out += sum c_i * x_i[start:stop]: one axpy per array; int8 sources decode into tmp
    (L2/L3-resident) and add, sparse ones add their few values in place."""
    for x, c in zip(xs, cs, strict=True):
        if isinstance(x, np.ndarray):
            src = x.reshape(-1)[start:stop]
            if c == 1.0 and src.dtype == out.dtype:
                np.add(out, src, out=out)
            else:
                axpy(src, c, out, tmp)
        else:
            x.add_scaled(start, stop, c, out, tmp)


def norm(block: np.ndarray) -> float:
    """|block| >= its largest magnitude, one BLAS dot; inf if anything in it is not finite or
    the squares overflow (the block then goes exact). The limit of a quarter of the dtype's
    largest value leaves the dot's rounding plenty of headroom."""
    sq = float(np.dot(block, block))
    return math.sqrt(sq) if sq == sq else math.inf


def clamp(block: np.ndarray) -> None:
    top = np.finfo(block.dtype).max
    np.clip(block, -top, top, out=block)


def clamp_if_overflowed(block: np.ndarray) -> None:
    """clamp(block) where a value overflowed to +-inf; a dot (a read) instead of a clip (a read
    and a write) when nothing did, which is nearly always. Squares past the dtype's range
    also clamp, which leaves in-range values unchanged."""
    if not math.isfinite(float(np.dot(block, block))):
        clamp(block)
