"""A training round's update as a compressed delta (job key update_codec: int8 or top-k).

The engine asks for it with runner hyperparameters (taken out before the task sees the rest):
`update_codec`, `topk_fraction` and `update_codec_run` (the run the error-feedback residual
belongs to). The round's worker then writes, instead of its weights, the delta from the global
model it received, compressed by fedgpu.core.update_codecs with error feedback. The residual
stays on this node between rounds, in the work root beside the rounds' own directories, named
by this node's data directory (several nodes on one host keep apart) as safetensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core import codec
from fedgpu.core.update_codecs import ErrorFeedback, UpdateCodec
from fedgpu.node.tasks.base import HyperparameterError

KEYS = ("update_codec", "topk_fraction", "update_codec_run")


@dataclass(frozen=True)
class CodecAsk:
    kind: UpdateCodec
    topk_fraction: float
    run: str


def take(hparams: dict[str, Any]) -> CodecAsk | None:
    """Take the codec's keys out of `hparams` (in place); None when no codec is asked for."""
    given = {k: hparams.pop(k) for k in KEYS if k in hparams}
    if not given:
        return None
    try:
        kind = UpdateCodec(given.get("update_codec", "none"))
    except ValueError:
        raise HyperparameterError(
            f"hyperparameter update_codec must be one of "
            f"{', '.join(c.value for c in UpdateCodec)}, got {given['update_codec']!r}") from None
    fraction = given.get("topk_fraction", 0.01)
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not (
            0 < fraction <= 1):
        raise HyperparameterError(f"hyperparameter topk_fraction must be in (0, 1], got "
                                  f"{fraction!r}")
    if kind is UpdateCodec.NONE:
        return None
    return CodecAsk(kind, float(fraction), str(given.get("update_codec_run", "")))


def residual_path(workdir: Path, data_dir: Path | None) -> Path:
    site = hashlib.sha256(str(Path(data_dir or "").resolve()).encode()).hexdigest()[:16]
    return Path(workdir).resolve().parent / f"fedgpu-residual-{site}.safetensors"


def write_delta(path: Path, ask: CodecAsk, base: Mapping[str, np.ndarray],
                trained: Mapping[str, np.ndarray], residual: Path,
                metadata: Mapping[str, str]) -> codec.Encoded:
    """Write trained - base, compressed with error feedback, as the round's payload."""
    delta: dict[str, np.ndarray] = {}
    for name, t in trained.items():
        b = base[name]
        if t.dtype.kind in "iub":
            delta[name] = t.astype(np.int64) - b.astype(np.int64)
        else:
            delta[name] = t.astype(np.float32) - b.astype(np.float32)
    ef = ErrorFeedback(ask.kind, ask.topk_fraction, residual, key=ask.run)
    tensors, meta = ef.compress(delta)
    encoded = codec.encode(tensors, {**metadata, **meta})
    with open(path, "wb") as f:
        for segment in encoded.segments:
            f.write(segment)
    return encoded
