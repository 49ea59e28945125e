"""A model as one flat vector, the way both ends of secure aggregation lay it out.

Sites mask the change their round made to the model (trained - global), not the weights: the
change is small, so a narrow clipping range keeps quantisation fine. Tensors go in sorted name
order, each flattened in C order, every dtype (integer buffers too, as FedAvg averages them).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedgpu.core.secagg.errors import SecAggError


def length(model: Mapping[str, np.ndarray]) -> int:
    return sum(int(np.prod(a.shape, dtype=np.int64)) for a in model.values())


def delta(trained: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]) -> np.ndarray:
    """trained - base as one float32 vector."""
    if set(trained) != set(base):
        raise SecAggError("the trained model's tensors differ from the global model's")
    out = np.empty(length(base), dtype=np.float32)
    pos = 0
    for name in sorted(base):
        a, b = trained[name], base[name]
        if a.shape != b.shape:
            raise SecAggError(f"tensor {name!r} has shape {a.shape}, the global model "
                              f"{b.shape}")
        n = a.size
        np.subtract(np.asarray(a, dtype=np.float32).reshape(-1),
                    np.asarray(b, dtype=np.float32).reshape(-1), out=out[pos:pos + n])
        pos += n
    return out


def apply(base: Mapping[str, np.ndarray], change: np.ndarray) -> dict[str, np.ndarray]:
    """base + change, each tensor back in its own dtype (integers rounded)."""
    if change.shape != (length(base),):
        raise SecAggError(f"a change of {change.size} values for a model of {length(base)}")
    out: dict[str, np.ndarray] = {}
    pos = 0
    for name in sorted(base):
        b = base[name]
        n = b.size
        values = np.asarray(b, dtype=np.float64).reshape(-1) + change[pos:pos + n]
        if b.dtype.kind in "iub":
            values = np.rint(values)
        out[name] = values.astype(b.dtype).reshape(b.shape)
        pos += n
    return out
