"""One step along a round's mean from the global model, longer or shorter: FedNova's normalised
step and FedBuff's buffer factor. Pure array math, beside strategies/aggregate.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.server.strategies.aggregate import acc_dtype, cast_back


def scaled_step(base: Mapping[str, Any], mean: Mapping[str, np.ndarray],
                factor: float) -> dict[str, np.ndarray]:
    """base + factor * (mean - base), tensor by tensor, in each tensor's accumulation dtype:
    a mean moved further or shorter along its own direction (FedNova's normalised step,
    FedBuff's buffer factor). Integer tensors take the mean as it is. Overflow shows as a
    non-finite model, which the engine refuses and retries."""
    out: dict[str, np.ndarray] = {}
    with np.errstate(over="ignore", invalid="ignore"):
        for name, m in mean.items():
            b = np.asarray(base[name])
            if b.dtype.kind in "iub":
                out[name] = m
                continue
            dt = acc_dtype(b.dtype)
            x = b.astype(dt)
            out[name] = cast_back(x + factor * (m.astype(dt) - x), b.dtype)
    return out
