"""Kernels of the weighted sum, one block of the sum at a time: out = c * x, out += c * x,
a bound on a block's norm, and the clamp to the dtype's range. x is an array or a block source
(fedgpu.core.update_codecs: int8 and top-k updates decoded block by block).

out += c * x is BLAS axpy (scipy's OpenBLAS): one fused pass that reads x and reads and writes
out once. numpy has no fused multiply-add; its w * x into an L2-resident scratch, then the add,
measured 1.6-1.9x the time of axpy on 10 x 11M float32 (BENCHMARKS.md section 12). Two arrays
at a time go through one compiled loop (fedgpu.core.fused_loops: out += c1 x1 + c2 x2), one
pass over out for both.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fedgpu.core import fused_loops

Axpy = Callable[..., np.ndarray]


_limit_lock = threading.Lock()
# Per thread: OpenBLAS's thread count, as threadpoolctl sets it, held only for the thread that
# set it here (measured: a fold on another worker thread of the aggregator still split its
# axpy in two, and the scalar tails of the two halves round without FMA, so the same update
# folded on two threads differed in a few last bits; benchmarks/spill.py found it).
_limited = threading.local()


def _one_thread_each() -> None:
    from threadpoolctl import ThreadpoolController

    with _limit_lock:  # threadpoolctl sees the BLAS libraries loaded when it looks
        ThreadpoolController().limit(limits=1, user_api="blas")


@functools.cache
def _axpys() -> dict[np.dtype, Axpy]:
    # Imported on first use: scipy.linalg takes ~0.3 s and ~24 MiB to load, paid by the
    # first sum that needs an axpy instead of every aggregator start (top-k sums never do).
    from scipy.linalg import blas

    _one_thread_each()  # scipy's OpenBLAS is a library apart from numpy's
    return {np.dtype(np.float32): blas.saxpy, np.dtype(np.float64): blas.daxpy}


def blas_on_one_thread() -> None:
    """From the first sum on, numpy's BLAS (and scipy's, once an axpy loads it) runs on one
    thread, process-wide.

    OpenBLAS splits an axpy over 10k values across every core; with the aggregator's other
    threads (receive, digest, decode) and other processes on the same cores, its spinning
    workers made one 11M-value update 2-10x slower than one thread (measured on 2 shared
    vCPUs), and one thread already reads memory at the speed of a plain numpy add. Nothing
    else the aggregator runs needs BLAS threads. Set once in each thread that sums, and
    kept: the count held only for the thread that set it (a fold on another worker thread
    split its axpy in two), and raising it back from another thread did not take effect
    (measured, OpenBLAS 0.3.30), so a per-sum restore would not be reliable anyway.
    torch's threads (OpenMP) are not BLAS's."""
    if not getattr(_limited, "done", False):
        _one_thread_each()
        _limited.done = True


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


def _pairs(name: str, n: int, out: np.ndarray) -> fused_loops.Kernel | None:
    """The compiled two-array loop `name` where n inputs may pair up in out's dtype."""
    if n < 2 or out.dtype not in fused_loops.OUT_DTYPES or not out.flags.c_contiguous:
        return None
    return fused_loops.kernel(name)


def _dense(x: Any, out: np.ndarray) -> bool:
    return isinstance(x, np.ndarray) and x.dtype == out.dtype


def _run_pair(k: fused_loops.Kernel, x1: np.ndarray, c1: float, x2: np.ndarray, c2: float,
              start: int, stop: int, out: np.ndarray) -> None:
    t = out.dtype.type
    k(out, t(c1), np.ascontiguousarray(x1.reshape(-1)[start:stop]),
      t(c2), np.ascontiguousarray(x2.reshape(-1)[start:stop]))


def sum_into(xs: Sequence[Any], cs: Sequence[float], start: int, stop: int,
             out: np.ndarray, tmp: np.ndarray) -> None:
    """out = sum c_i * x_i[start:stop]."""
    k = _pairs("write2", len(xs), out)
    if k is not None and _dense(xs[0], out) and _dense(xs[1], out):
        _run_pair(k, xs[0], cs[0], xs[1], cs[1], start, stop, out)
        fold(xs[2:], cs[2:], start, stop, out, tmp)
        return
    write(xs[0], cs[0], start, stop, out)
    fold(xs[1:], cs[1:], start, stop, out, tmp)


def fold(xs: Sequence[Any], cs: Sequence[float], start: int, stop: int,
         out: np.ndarray, tmp: np.ndarray) -> None:
    """out += sum c_i * x_i[start:stop]: arrays of out's dtype two per compiled pass, others
    one axpy each; int8 sources decode into out in one compiled pass (or into tmp, then add),
    sparse ones add their few values in place."""
    k = _pairs("fold2", len(xs), out)
    held: tuple[np.ndarray, float] | None = None  # an array waiting for its partner
    for x, c in zip(xs, cs, strict=True):
        if k is None or not _dense(x, out):
            _fold_one(x, c, start, stop, out, tmp)
        elif held is None:
            held = (x, c)
        else:
            _run_pair(k, held[0], held[1], x, c, start, stop, out)
            held = None
    if held is not None:
        _fold_one(held[0], held[1], start, stop, out, tmp)


def _fold_one(x: Any, c: float, start: int, stop: int, out: np.ndarray,
              tmp: np.ndarray) -> None:
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


def block_norm(x: Any, start: int, stop: int, tmp: np.ndarray) -> float:
    """|x[start:stop]|: a dot over the input itself where it has the sum's dtype, else over
    its values written into tmp in that dtype (a decoded block, a widened float16 one)."""
    if isinstance(x, np.ndarray) and x.dtype == tmp.dtype:
        return norm(x.reshape(-1)[start:stop])
    return norm(write(x, 1.0, start, stop, tmp))


def clamp(block: np.ndarray) -> None:
    top = np.finfo(block.dtype).max
    np.clip(block, -top, top, out=block)


def clamp_if_overflowed(block: np.ndarray) -> None:
    """clamp(block) where a value overflowed to +-inf; a dot (a read) instead of a clip (a read
    and a write) when nothing did, which is nearly always. Squares past the dtype's range
    also clamp, which leaves in-range values unchanged."""
    with np.errstate(over="ignore"):  # squares past the range: expected, handled
        sq = float(np.dot(block, block))
    if not math.isfinite(sq):
        clamp(block)
