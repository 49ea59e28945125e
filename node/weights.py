"""Model weights between torch and the wire codec, without copies the hardware does not need.

In: the safetensors file is read once into host memory, decoded into numpy views of that buffer
and each view is wrapped as a torch tensor over the same memory; one host-to-device copy per
tensor then lands it in the parameter that already lives on the device. Out: parameters are
viewed as numpy arrays (CPU) or copied once to the host (CUDA) and written as codec segments.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from fedgpu.core import codec

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_BF16 = np.dtype(ml_dtypes.bfloat16)


class WeightsError(ValueError):
    """Weights that do not fit the task's model, or a file that is not a tensor set."""


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """Decode a safetensors file into writable numpy views of one host buffer."""
    try:
        return codec.read_file(path)
    except OSError as exc:
        raise WeightsError(f"cannot read weights {path}: {exc.strerror or exc}") from None
    except codec.CodecError as exc:
        raise WeightsError(f"weights {path} are not a valid safetensors payload: {exc}") from None


def to_torch(arr: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing `arr`'s memory."""
    if arr.dtype == _BF16:
        # torch.from_numpy does not know ml_dtypes; the bits are the same, so reinterpret.
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array over `tensor`'s memory on the CPU, or over one host copy of a device one."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def load_into(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy `arrays` into the model's existing tensors, wherever they live (dtype converted)."""
    state = model.state_dict()
    missing = sorted(set(state) - set(arrays))
    extra = sorted(set(arrays) - set(state))
    if missing or extra:
        raise WeightsError(
            "received weights do not match the task's model: "
            + "; ".join(
                part
                for part in (
                    f"missing {_names(missing)}" if missing else "",
                    f"unexpected {_names(extra)}" if extra else "",
                )
                if part
            )
        )
    for name, target in state.items():
        arr = arrays[name]
        if tuple(arr.shape) != tuple(target.shape):
            raise WeightsError(
                f"received tensor {name!r} has shape {tuple(arr.shape)}, the model's is "
                f"{tuple(target.shape)}"
            )
    with torch.no_grad():
        for name, target in state.items():
            # state_dict() tensors alias the parameters, so copy_ writes the model in place:
            # one host-to-device transfer, no second copy of the model on the device.
            target.copy_(to_torch(arrays[name]))


def state_arrays(
    model: torch.nn.Module, wire_dtypes: Mapping[str, str] | None = None
) -> dict[str, np.ndarray]:
    """The model's state as numpy arrays, cast to `wire_dtypes` (codec names) where given.

    Casting happens on the device, before the host copy, so a BF16 wire halves the transfer.
    """
    out: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        wire = (wire_dtypes or {}).get(name)
        if wire is not None and TORCH_DTYPES[wire] != tensor.dtype:
            tensor = tensor.to(TORCH_DTYPES[wire])
        out[name] = to_numpy(tensor)
    return out


def non_finite(model: torch.nn.Module) -> list[str]:
    """Names of floating-point state tensors holding NaN or infinity."""
    return [
        name
        for name, t in model.state_dict().items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]


def write_weights(
    path: Path, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> codec.Encoded:
    encoded = codec.encode(arrays, metadata)
    with open(path, "wb") as f:
        for segment in encoded.segments:
            f.write(segment)
    return encoded


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
