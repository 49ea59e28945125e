"""The weighted sum's block kernels: BLAS axpy in place (or numpy where no BLAS routine fits),
the process-wide one-BLAS-thread limit, and the clamp after an offset is added."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fedgpu.server.strategies import block_math
from fedgpu.server.strategies.aggregate import WeightedSum

TOP = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_axpy_updates_only_its_slice_in_place_from_a_read_only_input(dtype: type) -> None:
    rng = np.random.default_rng(1)
    # Read-only, as a decoded update's arrays are (views of the received bytes).
    x = np.frombuffer(rng.standard_normal(1000).astype(dtype).tobytes(), dtype)
    assert not x.flags.writeable
    whole = rng.standard_normal(1200).astype(dtype)
    want = whole.copy()
    want[100:1100] += dtype(0.37) * x
    block_math.axpy(x, 0.37, whole[100:1100], np.empty(1000, dtype))
    np.testing.assert_allclose(whole, want, rtol=1e-6, atol=1e-6)  # FMA rounds once
    assert np.array_equal(whole[:100], want[:100]) and np.array_equal(whole[1100:], want[1100:])


def test_axpy_widens_a_half_precision_input_through_the_scratch() -> None:
    x = np.linspace(-3, 3, 500).astype(np.float16)
    out = np.ones(500, np.float32)
    tmp = np.full(500, np.nan, np.float32)
    block_math.axpy(x, 2.0, out, tmp)
    np.testing.assert_allclose(out, 1 + 2 * x.astype(np.float32), rtol=1e-6)


def test_the_first_sum_puts_blas_on_one_thread_for_the_whole_process() -> None:
    # A fresh process (the limit is process-wide and kept); the sum runs in a worker thread,
    # as the aggregator's do, and the limit holds for the main thread afterwards.
    script = """
import json, threading
import numpy as np
from threadpoolctl import ThreadpoolController
from fedgpu.server.strategies.aggregate import WeightedSum

def threads():
    return [lib["num_threads"] for lib in ThreadpoolController().select(user_api="blas").info()]

before = threads()
def one_sum():
    acc = WeightedSum({"w": np.zeros(100, np.float32)})
    acc.add({"w": np.ones(100, np.float32)}, 2.0)
    acc.add({"w": np.ones(100, np.float32)}, 3.0)  # an axpy: scipy's BLAS loaded and limited
    acc.mean()
t = threading.Thread(target=one_sum)
t.start()
t.join()
print(json.dumps({"before": before, "after": threads()}))
"""
    got = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True,
                                    text=True, check=True, timeout=120).stdout)
    # numpy's OpenBLAS before; scipy's too after (a library of its own in the wheels, loaded
    # by the axpy), every one on one thread.
    assert got["before"] and len(got["after"]) >= len(got["before"])
    assert set(got["after"]) == {1}


def test_an_offset_that_overflows_the_mean_is_clamped_not_inf() -> None:
    acc = WeightedSum({"w": np.zeros(300, np.float32)})
    acc.add({"w": np.full(300, TOP / 2, np.float32)}, 1.0)
    base = np.full(300, TOP, np.float32)
    base[:10] = 1.0  # these stay ordinary values
    got = acc.mean(offset={"w": base})["w"]
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got[10:], TOP)
    np.testing.assert_allclose(got[:10], TOP / 2, rtol=1e-6)


def test_clamp_if_overflowed_leaves_finite_blocks_alone() -> None:
    block = np.array([1.0, -2.5, 3e30], np.float32)  # squares overflow, values do not
    block_math.clamp_if_overflowed(block)
    np.testing.assert_array_equal(block, np.array([1.0, -2.5, 3e30], np.float32))
    inf = np.array([np.inf, -np.inf, 4.0], np.float32)
    block_math.clamp_if_overflowed(inf)
    np.testing.assert_array_equal(inf, np.array([TOP, -TOP, 4.0], np.float32))
