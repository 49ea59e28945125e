"""FedYogi: Yogi on the server over the pseudo-gradient of the streamed weighted mean
(Reddi et al. 2021; Flower's FedYogi, same parameters and defaults: the table's row)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.server.strategies.base import Weights
from fedgpu.server.strategies.server_opt import ServerOptimizer
from fedgpu.server.strategies.server_opt_math import yogi_step


class FedYogi(ServerOptimizer):
    name = "fedyogi"
    slots = ("m", "v")

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.eta = self.number("eta")
        self.beta_1 = self.number("beta_1")
        self.beta_2 = self.number("beta_2")
        self.tau = self.number("tau")

    def step(self, global_weights: Mapping[str, np.ndarray], mean: Weights,
             arrays: dict[str, dict[str, np.ndarray]]) -> Weights:
        return yogi_step(global_weights, mean, arrays["m"], arrays["v"], self.eta, self.beta_1,
                         self.beta_2, self.tau)
