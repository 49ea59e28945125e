"""Loops numpy cannot run in one pass over memory, compiled by numba on first use.

The aggregator's weighted sum is bound by memory traffic, not arithmetic. numpy runs one
operation per pass, so `out += c1 * x1 + c2 * x2` or an int8 decode-scale-add takes two to
four passes over arrays larger than any cache; a compiled loop takes one. Measured on 10 x 11M
float32 (one core, BENCHMARKS.md section 12): the mean of K updates in memory 1.51x the
read-once bound with two per pass, 1.75x with one BLAS axpy each; int8 decoded straight into
the sum 1.20x, where int8 -> float into a scratch and then a scaled add was 2.03x.

Every kernel has a numpy fallback (`None` from its getter): numba is a dependency of the
base install, but a Python it does not support yet, or a kernel that fails its check on a
small case (run once per process), must still let the aggregator sum, only slower.

Compilation takes ~0.3 s per kernel and argument types, once per process; the machine code
is cached on disk (numba's cache, next to this file or in the user's cache directory) where
one is writable, so later processes load it in milliseconds. Where none is (a read-only image
and home), it compiles in memory each time.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

Kernel = Callable[..., None]
log = logging.getLogger("fedgpu.core.fused_loops")
# The sums the loops are for: out (and the scalars) in one of these.
OUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_compile_lock = threading.Lock()


def _fold2(out: Any, c1: Any, x1: Any, c2: Any, x2: Any) -> None:  # pragma: no cover - jit
    for i in range(out.size):
        out[i] += c1 * x1[i] + c2 * x2[i]


def _write2(out: Any, c1: Any, x1: Any, c2: Any, x2: Any) -> None:  # pragma: no cover - jit
    for i in range(out.size):
        out[i] = c1 * x1[i] + c2 * x2[i]


def _int8_add(out: Any, c: Any, q: Any, scales: Any, start: int,
              block: int) -> None:  # pragma: no cover - jit
    # out[i] += c * scales[(start + i) // block] * q[start + i], one scale block at a time.
    # The inner loop runs over slices: indices it can prove non-negative, so numba adds no
    # wraparound check and the loop vectorises (indexing q[start + k] directly ran 10x slower).
    n = out.size
    i = 0
    while i < n:
        b = (start + i) // block
        end = min(n, (b + 1) * block - start)
        f = c * scales[b]
        o = out[i:end]
        v = q[start + i:start + end]
        for k in range(o.size):
            o[k] += f * v[k]
        i = end


_LOOPS: dict[str, Callable[..., None]] = {"fold2": _fold2, "write2": _write2, "int8_add": _int8_add}


@functools.cache
def kernel(name: str) -> Kernel | None:
    """The compiled kernel `name` (fold2, write2, int8_add), or None (callers then use numpy)
    without numba or if it does not give numpy's answer on a small case, checked once.

    Compiled per argument types at their first call: arrays C-contiguous (read-only inputs
    too: decoded updates are views of received bytes), out float32 or float64, the scalars
    in out's dtype; callers check that and fall back to numpy otherwise."""
    with _compile_lock:  # numba's import and the check, once even from two threads
        try:
            import numba
        except ImportError:
            return None
        fn = _LOOPS[name]
        try:
            compiled = numba.njit(nogil=True, cache=True)(fn)
        except RuntimeError:
            # numba found no writable cache location ("no locator available"): compile in
            # memory instead.
            compiled = numba.njit(nogil=True)(fn)
        try:
            ok = _CHECKS[name](compiled)
        except Exception:  # noqa: BLE001 - a kernel that cannot run is one not to use
            log.warning("compiled loop %s failed its check; the sum uses numpy", name,
                        exc_info=True)
            return None
        if not ok:
            log.warning("compiled loop %s gave a wrong answer on its check; the sum uses "
                        "numpy", name)
            return None
        return compiled


def _read_only(x: np.ndarray) -> np.ndarray:
    y = x.copy()
    y.flags.writeable = False
    return y


def _check_pair(name: str) -> Callable[[Kernel], bool]:
    # The types the sum passes: float32 out, inputs read-only (received bytes) or not.
    def check(k: Kernel) -> bool:
        x = np.arange(1, 3001, dtype=np.float32)
        good = True
        for x1, x2 in ((x, x), (_read_only(x), _read_only(x[::-1]))):
            out = np.ones_like(x)
            k(out, np.float32(0.5), x1, np.float32(-2.0), x2)
            want = (1.0 if name == "fold2" else 0.0) + 0.5 * x1 - 2.0 * x2
            good = good and bool(np.allclose(out, want, rtol=1e-6))
        return good
    return check


def _check_int8(k: Kernel) -> bool:
    q = _read_only(np.tile(np.arange(-127, 128, dtype=np.int8), 12))
    scales = _read_only(np.array([0.5, 2.0, 1.0], np.float32))
    out = np.ones(2500, np.float32)
    k(out, np.float32(3.0), q, scales, 100, 1024)
    pos = np.arange(100, 2600)
    return bool(np.allclose(out, 1 + 3 * scales[pos // 1024] * q[pos], rtol=1e-6))


_CHECKS: dict[str, Callable[[Kernel], bool]] = {
    "fold2": _check_pair("fold2"), "write2": _check_pair("write2"), "int8_add": _check_int8}
