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
    # tau = 1e-3 as recommended by Reddi et al. (the table's default); it also caps the first
    # steps at ~eta.
    slots = ("m", "v")

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.eta = self.number("eta")
        self.beta1 = self.number("beta_1")
        self.beta2 = self.number("beta_2")
        self.tau = self.number("tau")

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
