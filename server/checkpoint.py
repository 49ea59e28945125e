"""Checkpoints of finished rounds: global weights (safetensors) and run state (JSON).

Every file is written to a temporary name, fsynced and renamed, so a crash at any moment
leaves either the previous checkpoint or the new one, never a torn file. state.json is the
commit point: it names its round's weights file (`global-NNNNNN.safetensors`) and that file's
sha256, and older weights are deleted only after it is written, so a crash between two writes
never pairs a state with another round's weights. `global.safetensors` is a hard link to the
latest weights: a stable name for people and tools.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core import codec
from fedgpu.core.errors import FedgpuError

WEIGHTS = "global.safetensors"
STATE = "state.json"
ROUND_WEIGHTS = "global-{:06d}.safetensors"
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
    _fsync_dir(path.parent)


class CheckpointError(FedgpuError):
    """A state directory that cannot be resumed from; the message names the file and fix."""

    exit_code = 2


def _fsync_dir(directory: Path) -> None:
    # A rename is durable only once the directory entry is flushed.
    dir_fd = os.open(directory, os.O_RDONLY)
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
        name = ROUND_WEIGHTS.format(int(state.get("global_round", 0)))
        # Weights first: a state.json always points at weights that are already durable.
        _atomic_write(self.directory / name, enc.segments)
        if tensors:
            # Also before state.json; tagged with the round so a crash between the two writes
            # is detected on load instead of pairing new moments with an old model.
            _atomic_write(self.directory / STRATEGY_TENSORS,
                          codec.encode(tensors, round_meta, digest=False).segments)
        state = {**state, "weights_file": name, "weights_sha256": enc.sha256}
        text = json.dumps(state, indent=1, allow_nan=False)  # strict: tools read state.json
        _atomic_write(self.directory / STATE, [text.encode()])
        link = self.directory / f".{WEIGHTS}.link"
        link.unlink(missing_ok=True)
        os.link(self.directory / name, link)
        os.replace(link, self.directory / WEIGHTS)
        for old in self.directory.glob("global-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)

    def load(self) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        spath = self.directory / STATE
        if not spath.exists():
            return None
        try:
            state = json.loads(spath.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read checkpoint {spath}: {exc}; move the state "
                                  "directory aside to start a fresh run") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {spath} is not a JSON object")
        wpath = self.directory / str(state.get("weights_file", WEIGHTS))
        try:
            data = wpath.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"checkpoint {spath} names weights {wpath}, which cannot be "
                                  f"read: {exc.strerror}") from None
        expected = state.get("weights_sha256")
        if expected and hashlib.sha256(data).hexdigest() != expected:
            raise CheckpointError(f"checkpoint weights {wpath} do not match the sha256 in "
                                  f"{spath}: the file was modified or damaged")
        try:
            tensors, _ = codec.decode(data)
        except codec.CodecError as exc:
            raise CheckpointError(f"checkpoint weights {wpath} are not valid: {exc}") from None
        return {k: np.array(v) for k, v in tensors.items()}, state

    def load_strategy_tensors(self, global_round: int) -> dict[str, np.ndarray] | None:
        """The strategy arrays saved with round `global_round`; None if there are none for it."""
        path = self.directory / STRATEGY_TENSORS
        if not path.exists():
            return None
        tensors, meta = codec.decode(path.read_bytes())
        if meta.get("global_round") != str(global_round):
            return None
        return {k: np.array(v) for k, v in tensors.items()}
