"""The global model as the sites download it: encoded once per model and shared by every
node's download, or, once checkpointed, the checkpoint's own file, whose mapped arrays then
stand for the model (a multi-GB model is not held twice)."""

from __future__ import annotations

import numpy as np

from fedgpu.core import codec
from fedgpu.server.rounds.checkpoint import SavedWeights, map_weights
from fedgpu.server.transfer.payload import ModelPayload, to_wire


class ServedModel:
    def __init__(self, wire_dtype: str | None) -> None:
        # In half precision the nodes get an encoding of their own, never the file.
        self.wire_dtype = wire_dtype
        self._payload: ModelPayload | None = None
        # The file the global model was last adopted from, and the arrays mapped from it.
        self._saved: tuple[SavedWeights, dict[str, np.ndarray]] | None = None

    def payload(self, weights: dict[str, np.ndarray], global_round: int) -> ModelPayload:
        """The download of `weights`, encoded on first use; forget() when the model changes."""
        if self._payload is None:
            enc = codec.encode(to_wire(weights, self.wire_dtype),
                               {"global_round": str(global_round)})
            self._payload = ModelPayload.from_encoded(enc)
        return self._payload

    def forget(self) -> None:
        self._payload = None

    def file_of(self, weights: dict[str, np.ndarray]) -> SavedWeights | None:
        """The checkpoint file `weights` were adopted from, if they are that file's very
        arrays (unchanged since): a commit of them writes nothing again."""
        return self._saved[0] if self._saved is not None and self._saved[1] is weights else None

    def adopt(self, saved: SavedWeights) -> dict[str, np.ndarray]:
        """Serve the model from its checkpoint file, and return the arrays to hold it by:
        read-only views of that file, so the aggregate they were computed in is freed."""
        if self.wire_dtype is None:
            self._payload = ModelPayload.from_file(saved.path, saved.digest, saved.algorithm,
                                                  saved.segment_digests)
        weights = map_weights(saved.path)
        self._saved = (saved, weights)
        return weights
