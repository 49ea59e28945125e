"""Checkpoints of finished rounds: global weights (safetensors) and the engine's state (JSON:
run id, round, strategy and optimiser state; a job's round history is in the state store,
server/jobs/job_checkpoint.py splits the two).

Every file is written to a temporary name, fsynced and renamed, so a crash at any moment
leaves either the previous checkpoint or the new one, never a torn file. state.json is the
commit point: it names its round's weights file (`global-NNNNNN.safetensors`) and that file's
digest (`weights_digest`, BLAKE3, named by `weights_digest_algorithm`; a state.json from before
names a `weights_sha256`, still checked), and older weights are deleted only after it is
written, so a crash between two writes never pairs a state with another round's weights.
`global.safetensors` is a hard link to the latest weights: a stable name for people and tools.

The weights file is in wire format, so it is also what nodes download
(server/transfer/payload.py), and loaded weights are read-only views of it mapped into
memory: a multi-GB global model costs page cache the kernel can drop, not a second copy in
the aggregator's own memory.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SavedWeights:
    """A round's weights file as written: what a download of it announces."""

    path: Path
    size: int
    digest: str
    algorithm: codec.DigestAlgo
    # Its segment digests when the pass that made `digest` gave them (BLAKE3_SEGMENTS);
    # None: to be hashed when first announced.
    segment_digests: bytes | None = None


def map_weights(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file as read-only arrays over a private mapping of it (the mapping stays
    valid after the file is replaced or deleted). CodecError if it is not valid."""
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    tensors, _ = codec.decode(mm)  # the arrays keep the mapping alive
    return tensors


class Checkpointer:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def save(self, weights: Mapping[str, np.ndarray], state: Mapping[str, Any],
             tensors: Mapping[str, np.ndarray] | None = None,
             same_as: SavedWeights | None = None) -> SavedWeights:
        """`same_as`: the file `weights` were last saved to (unchanged since): kept as it is,
        instead of encoding and writing the same model again (for a multi-GB model, seconds of
        hashing and every page of its mapping read back into memory)."""
        round_meta = {"global_round": str(state.get("global_round", 0))}
        name = ROUND_WEIGHTS.format(int(state.get("global_round", 0)))
        if same_as is not None and same_as.path == self.directory / name \
                and same_as.path.exists():
            size, digest, algorithm = same_as.size, same_as.digest, same_as.algorithm
            segs = same_as.segment_digests
        else:
            enc = codec.encode(weights, round_meta)
            assert enc.algorithm is not None
            size, digest, algorithm = enc.size, enc.digest, enc.algorithm
            segs = enc.segment_digests if algorithm is codec.DigestAlgo.BLAKE3_SEGMENTS \
                else None
            # Weights first: a state.json always points at weights that are already durable.
            _atomic_write(self.directory / name, enc.segments)
        if tensors:
            # Also before state.json; tagged with the round so a crash between the two writes
            # is detected on load instead of pairing new moments with an old model.
            _atomic_write(self.directory / STRATEGY_TENSORS,
                          codec.encode(tensors, round_meta, digest=None).segments)
        state = {**state, "weights_file": name, "weights_digest_algorithm": algorithm.value,
                 "weights_digest": digest}
        text = json.dumps(state, indent=1, allow_nan=False)  # strict: tools read state.json
        _atomic_write(self.directory / STATE, [text.encode()])
        link = self.directory / f".{WEIGHTS}.link"
        link.unlink(missing_ok=True)
        os.link(self.directory / name, link)
        os.replace(link, self.directory / WEIGHTS)
        for old in self.directory.glob("global-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)
        return SavedWeights(self.directory / name, size, digest, algorithm, segs)

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
        algo, expected = _named_digest(state)
        try:
            if expected and codec.digest_file(wpath, algo) != expected:
                raise CheckpointError(f"checkpoint weights {wpath} do not match the {algo} in "
                                      f"{spath}: the file was modified or damaged")
            tensors = map_weights(wpath)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {spath} names weights {wpath}, which cannot be "
                                  f"read: {exc.strerror}") from None
        except codec.CodecError as exc:
            raise CheckpointError(f"checkpoint weights {wpath} are not valid: {exc}") from None
        return tensors, state

    def saved(self, state: Mapping[str, Any]) -> SavedWeights | None:
        """The weights file a loaded state names, when its digest is the wire's
        (BLAKE3_SEGMENTS; a state.json of an older version, with plain BLAKE3, is re-encoded)."""
        algo, digest = _named_digest(state)
        path = self.directory / str(state.get("weights_file", WEIGHTS))
        if algo is not codec.WIRE_DIGEST or not digest or not path.exists():
            return None
        return SavedWeights(path, path.stat().st_size, digest, algo)

    def load_strategy_tensors(self, global_round: int) -> dict[str, np.ndarray] | None:
        """The strategy arrays saved with round `global_round`; None if there are none for it."""
        path = self.directory / STRATEGY_TENSORS
        if not path.exists():
            return None
        tensors, meta = codec.decode(path.read_bytes())
        if meta.get("global_round") != str(global_round):
            return None
        return {k: np.array(v) for k, v in tensors.items()}


def _named_digest(state: Mapping[str, Any]) -> tuple[codec.DigestAlgo, str]:
    """(algorithm, digest) of the weights a state.json names; digest "" when it names none."""
    if "weights_digest" in state:
        try:
            algo = codec.DigestAlgo(state.get("weights_digest_algorithm"))
        except ValueError:
            raise CheckpointError(f"state.json names an unknown digest algorithm "
                                  f"{state.get('weights_digest_algorithm')!r}") from None
        return algo, str(state["weights_digest"])
    return codec.DigestAlgo.SHA256, str(state.get("weights_sha256") or "")
