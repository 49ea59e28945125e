"""FedAvgM: server momentum on the pseudo-gradient of the streamed weighted mean."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from server.aggregate import momentum_step
from server.strategies.base import Weights
from server.strategies.fedavg import FedAvg


class FedAvgM(FedAvg):
    name = "fedavgm"
    defaults = {"server_lr": 1.0, "momentum": 0.9}

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.server_lr = self.param("server_lr", lambda v: v > 0, "a positive number")
        self.momentum = self.param("momentum", lambda v: 0 <= v < 1, "a number in [0, 1)")
        self.velocity: dict[str, np.ndarray] = {}
        self.steps = 0
        self._global: Mapping[str, np.ndarray] | None = None

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        super().begin_round(global_weights)
        self._global = global_weights

    def finish(self) -> Weights:
        assert self._global is not None, "begin_round first"
        mean = super().finish()
        new = momentum_step(self._global, mean, self.velocity, self.server_lr, self.momentum)
        self.steps += 1
        self._global = None
        return new

    def state(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def tensor_state(self) -> dict[str, np.ndarray]:
        return {f"velocity/{k}": v for k, v in self.velocity.items()}

    def load_state(self, state: Mapping[str, Any],
                   tensors: Mapping[str, np.ndarray] | None = None) -> None:
        self.steps = int(state.get("steps", 0))
        self.velocity = _prefixed(tensors or {}, "velocity/")


def _prefixed(tensors: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    # Copies: checkpoint tensors may be read-only views of a file's bytes.
    return {k[len(prefix):]: np.array(v) for k, v in tensors.items() if k.startswith(prefix)}
