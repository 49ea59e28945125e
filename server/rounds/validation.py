"""Checks an update must pass before it may touch the aggregate. Pure: arrays in, verdict out."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedgpu.core import codec
from fedgpu.server.rounds.states import Reject


class UpdateRejected(Exception):
    """An update that must not be aggregated; `reason` is its counter key."""

    def __init__(self, reason: Reject, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def decode_and_check(
    payload: bytes | bytearray | memoryview,
    expected: Mapping[str, tuple[str, tuple[int, ...]]] | None,
) -> dict[str, np.ndarray]:
    """Decode and validate; `expected=None` accepts any names (the initial model defines them)."""
    try:
        tensors, _ = codec.decode(payload)
    except codec.CodecError as exc:
        raise UpdateRejected(Reject.MALFORMED,
                             f"payload is not a valid tensor set: {exc}") from None
    if expected is not None:
        check_spec(tensors, expected)
    check_finite(tensors)
    return tensors


def check_spec(
    tensors: Mapping[str, np.ndarray], expected: Mapping[str, tuple[str, tuple[int, ...]]]
) -> None:
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}")
        if extra:
            parts.append(f"unexpected {', '.join(extra[:5])}")
        raise UpdateRejected(
            Reject.NAMES, f"tensor names differ from the global model: {'; '.join(parts)}")
    for name, (dtype, shape) in expected.items():
        got_dtype = codec.dtype_name(tensors[name].dtype)
        got_shape = tuple(tensors[name].shape)
        if got_dtype != dtype:
            raise UpdateRejected(
                Reject.DTYPE, f"tensor {name!r} has dtype {got_dtype}, the global model has {dtype}"
            )
        if got_shape != tuple(shape):
            raise UpdateRejected(
                Reject.SHAPE, f"tensor {name!r} has shape {list(got_shape)}, expected {list(shape)}"
            )


def check_finite(tensors: Mapping[str, np.ndarray]) -> None:
    bad = first_non_finite(tensors)
    if bad is not None:
        raise UpdateRejected(Reject.NON_FINITE, f"tensor {bad!r} contains NaN or Inf values")


def first_non_finite(tensors: Mapping[str, np.ndarray]) -> str | None:
    """The name of the first tensor holding NaN or Inf; None when all are finite."""
    for name, arr in tensors.items():
        if arr.dtype.kind in "iub" or arr.size == 0:
            continue
        # bfloat16/float16 are checked in float32 chunks; isfinite on them is slow or missing.
        flat = arr.reshape(-1)
        step = 1 << 22
        for start in range(0, flat.size, step):
            part = flat[start : start + step]
            if part.dtype.itemsize < 4:
                part = part.astype(np.float32)
            if not np.isfinite(part).all():
                return name
    return None
