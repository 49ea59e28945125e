"""Server optimisers: FedAvg's streamed mean, then an optimiser step on the pseudo-gradient
(global - mean), with its state (named arrays) checkpointed beside the global weights."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.server.strategies.base import Weights
from fedgpu.server.strategies.fedavg import FedAvg


class ServerOptimizer(FedAvg):
    # Each named slot is a dict of arrays keyed like the model, saved as "<slot>/<tensor>".
    slots: tuple[str, ...] = ()

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.arrays: dict[str, dict[str, np.ndarray]] = {s: {} for s in self.slots}
        self.steps = 0
        self._global: Mapping[str, np.ndarray] | None = None

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        super().begin_round(global_weights)
        self._global = global_weights

    def finish(self) -> Weights:
        assert self._global is not None, "begin_round first"
        new = self.step(self._global, super().finish())
        self.steps += 1
        self._global = None
        return new

    @abstractmethod
    def step(self, global_weights: Mapping[str, np.ndarray], mean: Weights) -> Weights:
        """The new global model from the old one and this round's weighted mean."""

    def state(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def tensor_state(self) -> dict[str, np.ndarray]:
        return {f"{slot}/{k}": a for slot, named in self.arrays.items() for k, a in named.items()}

    def load_state(self, state: Mapping[str, Any],
                   tensors: Mapping[str, np.ndarray] | None = None) -> None:
        self.steps = int(state.get("steps", 0))
        for slot in self.slots:
            prefix = f"{slot}/"
            # Copies: checkpoint tensors may be read-only views of a file's bytes.
            self.arrays[slot] = {k[len(prefix):]: np.array(v) for k, v in (tensors or {}).items()
                                 if k.startswith(prefix)}
