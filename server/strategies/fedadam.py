"""FedAdam: Adam on the server over the pseudo-gradient of the streamed weighted mean."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from server.aggregate import adam_step
from server.strategies.base import Weights
from server.strategies.fedavg import FedAvg
from server.strategies.fedavgm import _prefixed


class FedAdam(FedAvg):
    name = "fedadam"
    # tau = 1e-3 as recommended by Reddi et al.; it also caps the first steps at ~eta.
    defaults = {"eta": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.eta = self.param("eta", lambda v: v > 0, "a positive number")
        self.beta1 = self.param("beta1", lambda v: 0 <= v < 1, "a number in [0, 1)")
        self.beta2 = self.param("beta2", lambda v: 0 <= v < 1, "a number in [0, 1)")
        self.tau = self.param("tau", lambda v: v > 0, "a positive number")
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self.steps = 0
        self._global: Mapping[str, np.ndarray] | None = None

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        super().begin_round(global_weights)
        self._global = global_weights

    def finish(self) -> Weights:
        assert self._global is not None, "begin_round first"
        mean = super().finish()
        new = adam_step(self._global, mean, self.m, self.v, self.eta, self.beta1, self.beta2,
                        self.tau)
        self.steps += 1
        self._global = None
        return new

    def state(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def tensor_state(self) -> dict[str, np.ndarray]:
        return {**{f"m/{k}": a for k, a in self.m.items()},
                **{f"v/{k}": a for k, a in self.v.items()}}

    def load_state(self, state: Mapping[str, Any],
                   tensors: Mapping[str, np.ndarray] | None = None) -> None:
        self.steps = int(state.get("steps", 0))
        self.m = _prefixed(tensors or {}, "m/")
        self.v = _prefixed(tensors or {}, "v/")
