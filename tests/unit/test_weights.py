"""fedgpu.node.weights: torch state <-> fedgpu.core.codec arrays, including BF16."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from fedgpu.core import codec
from fedgpu.node import weights
from fedgpu.node.tasks.digits import DigitsTask


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return DigitsTask().build_model({})


def test_cpu_tensors_become_numpy_without_a_copy() -> None:
    t = torch.arange(6, dtype=torch.float32)
    arr = weights.to_numpy(t)
    arr[0] = 42.0
    assert t[0] == 42.0


def test_bf16_round_trips_bit_exactly() -> None:
    t = torch.randn(4, 3).to(torch.bfloat16)
    arr = weights.to_numpy(t)
    assert arr.dtype == np.dtype(ml_dtypes.bfloat16)
    back = weights.to_torch(arr)
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)


def test_write_read_load_round_trip(tmp_path: Path) -> None:
    src, dst = _model(), DigitsTask().build_model({})
    weights.write_weights(tmp_path / "w.safetensors", weights.state_arrays(src))
    weights.load_into(dst, weights.read_arrays(tmp_path / "w.safetensors"))
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in src.state_dict().items())


def test_bf16_wire_loads_into_a_float32_model_and_goes_back_as_bf16(tmp_path: Path) -> None:
    src = _model()
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in weights.state_arrays(src).items()}
    dst = DigitsTask().build_model({})
    weights.load_into(dst, bf16)
    assert {p.dtype for p in dst.parameters()} == {torch.float32}
    out = weights.state_arrays(dst, {k: "BF16" for k in bf16})
    assert codec.spec(out) == codec.spec(bf16)
    assert all(np.array_equal(out[k].view(np.int16), bf16[k].view(np.int16)) for k in bf16)


def test_mismatched_weights_are_named(tmp_path: Path) -> None:
    arrays = weights.state_arrays(_model())
    arrays["extra.bias"] = np.zeros(3, np.float32)
    del arrays["fc2.bias"]
    with pytest.raises(weights.WeightsError, match="missing fc2.bias; unexpected extra.bias"):
        weights.load_into(_model(), arrays)
    arrays = weights.state_arrays(_model())
    arrays["fc2.bias"] = np.zeros(11, np.float32)
    with pytest.raises(weights.WeightsError, match=r"'fc2.bias' has shape \(11,\)"):
        weights.load_into(_model(), arrays)


def test_a_corrupt_file_is_a_weights_error(tmp_path: Path) -> None:
    (tmp_path / "w").write_bytes(b"garbage")
    with pytest.raises(weights.WeightsError, match="not a valid safetensors payload"):
        weights.read_arrays(tmp_path / "w")
