"""Checkpoints of finished rounds: global weights (safetensors) and run state (JSON).

Both files are written to a temporary name, fsynced and renamed, so a crash at any moment
leaves either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu import codec

WEIGHTS = "global.safetensors"
STATE = "state.json"
# Server-optimiser arrays (FedAvgM velocity, FedAdam moments): safetensors, never pickled.
STRATEGY_TENSORS = "strategy.safetensors"


def _atomic_write(path: Path, segments: list[bytes] | tuple[memoryview, ...]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        for seg in segments:
            fh.write(seg)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    # The rename itself is durable only once the directory entry is flushed.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Checkpointer:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def save(self, weights: Mapping[str, np.ndarray], state: Mapping[str, Any],
             tensors: Mapping[str, np.ndarray] | None = None) -> None:
        round_meta = {"global_round": str(state.get("global_round", 0))}
        enc = codec.encode(weights, round_meta)
        # Weights first: a state.json always points at weights at least as new as itself.
        _atomic_write(self.directory / WEIGHTS, enc.segments)
        if tensors:
            # Also before state.json; tagged with the round so a crash between the two writes
            # is detected on load instead of pairing new moments with an old model.
            _atomic_write(self.directory / STRATEGY_TENSORS,
                          codec.encode(tensors, round_meta, digest=False).segments)
        _atomic_write(self.directory / STATE, [json.dumps(state, indent=1).encode()])

    def load(self) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        wpath, spath = self.directory / WEIGHTS, self.directory / STATE
        if not (wpath.exists() and spath.exists()):
            return None
        tensors, _ = codec.decode(wpath.read_bytes())
        return {k: np.array(v) for k, v in tensors.items()}, json.loads(spath.read_text())

    def load_strategy_tensors(self, global_round: int) -> dict[str, np.ndarray] | None:
        """The strategy arrays saved with round `global_round`; None if there are none for it."""
        path = self.directory / STRATEGY_TENSORS
        if not path.exists():
            return None
        tensors, meta = codec.decode(path.read_bytes())
        if meta.get("global_round") != str(global_round):
            return None
        return {k: np.array(v) for k, v in tensors.items()}
