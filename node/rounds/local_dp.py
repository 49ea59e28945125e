"""Local differential privacy on the node: a job's `[privacy] mode = "local"`.

The aggregator names the clip and the noise in the training task (TaskHeader.privacy_local);
the agent puts them in task.json's "privacy" section, and the round's worker applies them here,
between training and the write of the update: the update (trained model - global model) is
clipped to `clip_norm` over all its floating-point tensors and Gaussian noise of std
`noise_multiplier * clip_norm` is added to every coordinate. The file the agent uploads is only
ever written from the result, so no unclipped update leaves the worker.

The arithmetic is fedgpu/core/privacy/mechanisms.py's (numpy, shared with the aggregator's
central mode); the noise's generator is seeded by the operating system, not by the job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core import codec
from fedgpu.core.privacy import mechanisms
from fedgpu.proto import pb

SECTION = "privacy"


class LocalDpError(ValueError):
    """task.json's privacy section cannot be used."""


@dataclass(frozen=True)
class LocalDp:
    clip_norm: float
    noise_multiplier: float


def from_header(header: pb.TaskHeader) -> dict[str, Any]:
    """task.json's privacy section from the task header, as the agent writes it; none when
    the job has no local DP."""
    if not header.HasField("privacy_local"):
        return {}
    dp = header.privacy_local
    return {SECTION: {"clip_norm": dp.clip_norm, "noise_multiplier": dp.noise_multiplier}}


def parse(raw: object) -> LocalDp | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise LocalDpError("task.json: 'privacy' must be an object")
    clip, noise = raw.get("clip_norm"), raw.get("noise_multiplier")
    for key, value, ok in (("clip_norm", clip, lambda v: v > 0),
                           ("noise_multiplier", noise, lambda v: v >= 0)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and ok(value)):
            raise LocalDpError(f"task.json: privacy.{key} must be a finite number "
                               f"({'> 0' if key == 'clip_norm' else '>= 0'}), got {value!r}")
    return LocalDp(float(clip), float(noise))  # type: ignore[arg-type]


def privatize(trained: Mapping[str, np.ndarray], global_: Mapping[str, np.ndarray] | Path,
              dp: LocalDp, metrics: dict[str, float],
              rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """The model to upload: global + noise(clip(trained - global)), each tensor in its
    trained dtype; `global_` may be the global model's file. Adds the update's norm and
    whether it was clipped to `metrics`."""
    if isinstance(global_, Path):
        global_ = codec.read_file(global_)
    clipped, norm = mechanisms.clip_local(trained, global_, dp.clip_norm)
    std = dp.noise_multiplier * dp.clip_norm
    update = {k: np.subtract(v, global_[k], dtype=np.float32) for k, v in clipped.items()
              if mechanisms.is_private(v)}
    noisy = mechanisms.add_gaussian_noise(update, std, rng or mechanisms.noise_generator(),
                                          inplace=True)
    out = mechanisms.apply_update(global_, noisy)
    metrics.update(ldp_update_norm=round(norm, 6), ldp_clipped=float(norm > dp.clip_norm),
                   ldp_noise_std=std)
    # The wire expects each tensor as the node trained it (a bf16 model stays bf16).
    return {k: (v if v.dtype == trained[k].dtype else v.astype(trained[k].dtype))
            for k, v in out.items()}

