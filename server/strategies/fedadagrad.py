"""FedAdagrad: Adagrad on the server over the pseudo-gradient of the streamed weighted mean
(Reddi et al. 2021; Flower's FedAdagrad, same parameters and defaults: the table's row)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.server.strategies.base import Weights
from fedgpu.server.strategies.server_opt import ServerOptimizer
from fedgpu.server.strategies.server_opt_math import adagrad_step


class FedAdagrad(ServerOptimizer):
    name = "fedadagrad"
    # The sum of squared pseudo-gradients; the first moment is the round's delta itself.
    slots = ("v",)

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.eta = self.number("eta")
        self.tau = self.number("tau")

    def step(self, global_weights: Mapping[str, np.ndarray], mean: Weights,
             arrays: dict[str, dict[str, np.ndarray]]) -> Weights:
        return adagrad_step(global_weights, mean, arrays["v"], self.eta, self.tau)
