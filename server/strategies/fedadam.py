"""FedAdam: Adam on the server over the pseudo-gradient of the streamed weighted mean."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.server.strategies.aggregate import adam_step
from fedgpu.server.strategies.base import Weights
from fedgpu.server.strategies.server_opt import ServerOptimizer


class FedAdam(ServerOptimizer):
    name = "fedadam"
    # tau = 1e-3 as recommended by Reddi et al.; it also caps the first steps at ~eta.
    defaults = {"eta": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    slots = ("m", "v")

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.eta = self.param("eta", lambda v: v > 0, "a positive number")
        self.beta1 = self.param("beta1", lambda v: 0 <= v < 1, "a number in [0, 1)")
        self.beta2 = self.param("beta2", lambda v: 0 <= v < 1, "a number in [0, 1)")
        self.tau = self.param("tau", lambda v: v > 0, "a positive number")

    @property
    def m(self) -> dict[str, np.ndarray]:
        return self.arrays["m"]

    @property
    def v(self) -> dict[str, np.ndarray]:
        return self.arrays["v"]

    def step(self, global_weights: Mapping[str, np.ndarray], mean: Weights,
             arrays: dict[str, dict[str, np.ndarray]]) -> Weights:
        return adam_step(global_weights, mean, arrays["m"], arrays["v"], self.eta, self.beta1,
                         self.beta2, self.tau)
