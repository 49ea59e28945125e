"""The compiled loops of the weighted sum (fedgpu/core/fused_loops.py), against numpy, and the
sum's pairing of inputs through them, against the exact mean."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from fedgpu.core import fused_loops
from fedgpu.core.update_codecs import BLOCK, UpdateCodec, decode_update, encode_update
from fedgpu.server.strategies import block_math

RNG = np.random.default_rng(7)


def _read_only(x: np.ndarray) -> np.ndarray:
    # As a decoded update's arrays are: views of the received bytes.
    y = np.frombuffer(x.tobytes(), x.dtype)
    assert not y.flags.writeable
    return y


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["fold2", "write2"])
def test_pair_loops_match_numpy_on_read_only_inputs(name: str, dtype: type) -> None:
    k = fused_loops.kernel(name)
    assert k is not None, "numba is a dependency of the base install"
    x1, x2 = (_read_only(RNG.standard_normal(5000).astype(dtype)) for _ in range(2))
    out = RNG.standard_normal(5000).astype(dtype)
    base = out.copy() if name == "fold2" else np.zeros_like(out)
    k(out, dtype(0.25), x1, dtype(-1.5), x2)
    want = base + dtype(0.25) * x1 + dtype(-1.5) * x2
    tol = 1e-6 if dtype == np.float32 else 1e-12  # one rounding order against another
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)


@pytest.mark.parametrize(("start", "n"), [(0, 3 * BLOCK), (100, 2 * BLOCK + 5), (BLOCK - 1, 2)])
def test_int8_loop_scales_each_value_by_its_own_block(start: int, n: int) -> None:
    k = fused_loops.kernel("int8_add")
    assert k is not None
    q = _read_only(RNG.integers(-127, 128, 4 * BLOCK, dtype=np.int8))
    scales = _read_only(RNG.random(4, dtype=np.float32))
    out = np.ones(n, np.float32)
    k(out, np.float32(2.0), q, scales, start, BLOCK)
    pos = np.arange(start, start + n)
    want = 1 + 2 * scales[pos // BLOCK] * q[pos].astype(np.float32)
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_fold_pairs_arrays_and_adds_the_rest_one_by_one() -> None:
    # Dense float32 (paired), float16 (widened), int8 and top-k sources, in any order: each
    # one lands once with its own weight.
    n = 3 * BLOCK
    dense = [RNG.standard_normal(n).astype(np.float32) for _ in range(3)]
    half = RNG.standard_normal(n).astype(np.float16)
    spec = {"w": ("F32", (n,))}
    q = decode_update(*encode_update({"w": dense[0]}, UpdateCodec.INT8), spec)["w"]
    t = decode_update(*encode_update({"w": dense[1]}, UpdateCodec.TOPK, 0.05), spec)["w"]
    xs = [dense[0], q, dense[1], half, t, dense[2]]
    cs = [0.5, 2.0, -1.0, 3.0, 0.25, 1.5]
    out = np.full(n, 4.0, np.float32)
    block_math.fold(xs, cs, 0, n, out, np.empty(n, np.float32))
    want = 4.0 + sum(c * (x.astype(np.float32) if isinstance(x, np.ndarray) else x.dense())
                     for x, c in zip(xs, cs, strict=True))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_without_numba_the_sum_falls_back_to_numpy() -> None:
    # A fresh process where `import numba` fails: no kernel, and a sum of pairs and int8
    # updates still gives the mean.
    script = """
import sys
sys.modules["numba"] = None
import numpy as np
from fedgpu.core import fused_loops
from fedgpu.core.update_codecs import UpdateCodec, decode_update, encode_update
from fedgpu.server.strategies.aggregate import WeightedSum
assert fused_loops.kernel("fold2") is None and fused_loops.kernel("int8_add") is None
xs = [np.full(5000, float(i), np.float32) for i in range(1, 4)]
acc = WeightedSum({"w": xs[0]})
acc.add_many([({"w": x}, 1.0) for x in xs])
src = decode_update(*encode_update({"w": xs[0]}, UpdateCodec.INT8), {"w": ("F32", (5000,))})
acc.add(src, 1.0)
mean = acc.mean()["w"]
assert np.allclose(mean, (1 + 2 + 3 + 1) / 4), mean[:3]
print("ok")
"""
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "ok"


@pytest.mark.parametrize("name", ["fold2", "write2", "int8_add"])
def test_a_kernel_that_adds_nothing_fails_its_check(name: str) -> None:
    # What kernel() runs once before handing a compiled loop out: a loop that leaves out
    # untouched (a miscompile) is caught, so the sum uses numpy instead.
    assert fused_loops._CHECKS[name](fused_loops.kernel(name))  # noqa: SLF001
    assert not fused_loops._CHECKS[name](lambda *args: None)  # noqa: SLF001
