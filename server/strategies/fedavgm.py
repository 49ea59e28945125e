"""FedAvgM: server momentum on the pseudo-gradient of the streamed weighted mean."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.server.strategies.aggregate import momentum_step
from fedgpu.server.strategies.base import Weights
from fedgpu.server.strategies.server_opt import ServerOptimizer


class FedAvgM(ServerOptimizer):
    name = "fedavgm"
    slots = ("velocity",)

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.server_lr = self.number("server_lr")
        self.momentum = self.number("momentum")

    @property
    def velocity(self) -> dict[str, np.ndarray]:
        return self.arrays["velocity"]

    def step(self, global_weights: Mapping[str, np.ndarray], mean: Weights,
             arrays: dict[str, dict[str, np.ndarray]]) -> Weights:
        return momentum_step(global_weights, mean, arrays["velocity"], self.server_lr,
                             self.momentum)
