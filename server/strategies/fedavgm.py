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
    defaults = {"server_lr": 1.0, "momentum": 0.9}
    slots = ("velocity",)

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.server_lr = self.param("server_lr", lambda v: v > 0, "a positive number")
        self.momentum = self.param("momentum", lambda v: 0 <= v < 1, "a number in [0, 1)")

    @property
    def velocity(self) -> dict[str, np.ndarray]:
        return self.arrays["velocity"]

    def step(self, global_weights: Mapping[str, np.ndarray], mean: Weights,
             arrays: dict[str, dict[str, np.ndarray]]) -> Weights:
        return momentum_step(global_weights, mean, arrays["velocity"], self.server_lr,
                             self.momentum)
