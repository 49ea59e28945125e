"""Checks an update must pass before it may touch the aggregate. Pure: arrays in, verdict out."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from fedgpu.core import codec
from fedgpu.core.finite_scan import FiniteResult, squares
from fedgpu.core.finite_scan import scanned as scanned_dtype
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.strategies.aggregate import Normed


def decode_and_check(
    payload: bytes | bytearray | memoryview,
    expected: Mapping[str, tuple[str, tuple[int, ...]]] | None,
    scanned: FiniteResult | None = None,
) -> Normed:
    """Decode and validate; `expected=None` accepts any names (the initial model defines them).
    `scanned`: the finite check taken as the payload's verified bytes landed
    (fedgpu/core/finite_scan.py), used when it covers exactly the tensors decoded here."""
    tensors = decode_checked(payload, expected)
    if scanned is None or scanned.names != tuple(tensors):
        return check_finite(tensors)
    if scanned.bad is not None:
        raise UpdateRejected(Reject.NON_FINITE,
                             f"tensor {scanned.bad!r} contains NaN or Inf values")
    return Normed(tensors, scanned.norms)


def decode_checked(payload: bytes | bytearray | memoryview,
                   expected: Mapping[str, tuple[str, tuple[int, ...]]] | None
                   ) -> dict[str, np.ndarray]:
    """The payload's tensors, refused when it is not a tensor set or (with `expected`) its
    names, dtypes or shapes are not the model's; not yet checked for finite values."""
    try:
        tensors, _ = codec.decode(payload)
    except codec.CodecError as exc:
        raise UpdateRejected(Reject.MALFORMED,
                             f"payload is not a valid tensor set: {exc}") from None
    if expected is not None:
        check_spec(tensors, expected)
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


def check_finite(tensors: Mapping[str, np.ndarray]) -> Normed:
    """The tensors, with the 2-norm of each (what FedAvg needs to know that they cannot
    overflow its sum), if every value is finite."""
    norms, bad = finite_norms(tensors)
    if bad is not None:
        raise UpdateRejected(Reject.NON_FINITE, f"tensor {bad!r} contains NaN or Inf values")
    return Normed(tensors, norms)


def first_non_finite(tensors: Mapping[str, np.ndarray]) -> str | None:
    """The name of the first tensor holding NaN or Inf; None when all are finite."""
    return finite_norms(tensors)[1]


def finite_norms(tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, float], str | None]:
    """(2-norm of each floating tensor, the first tensor holding NaN or Inf or None).

    One BLAS dot per chunk does both jobs in one read (faster than isfinite, which writes a
    mask): a NaN or Inf makes the dot non-finite. So do squares past the dtype's range, so a
    non-finite dot is confirmed by isfinite before the tensor is called bad; its norm is then
    unknown (inf) and the sum checks it block by block."""
    norms: dict[str, float] = {}
    for name, arr in tensors.items():
        if not scanned_dtype(arr.dtype, arr.size):
            continue
        sq = squares(arr.reshape(-1))
        if sq is None:
            return norms, name
        norms[name] = math.sqrt(sq)
    return norms, None
