"""FedNova: FedAvg corrected for unequal local work (server/strategies/hetero_math.py has the
arithmetic and the paper). Each update must say how many local steps it took (the nodes'
train metric `steps`); a site that ran 5x the steps then pulls no harder than the others."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from fedgpu.server.strategies.base import Weights
from fedgpu.server.strategies.fedavg import FedAvg
from fedgpu.server.strategies.hetero_math import (
    fednova_factor,
    fednova_weight,
    local_steps_norm,
)
from fedgpu.server.strategies.scaled import scaled_step


class FedNova(FedAvg):
    name = "fednova"
    # local_momentum: the momentum of the sites' SGD (the built-in tasks use 0.9); it sets how
    # many gradients tau steps add up to. server_lr scales the normalised step. max_factor caps
    # F (hetero_math.fednova_factor): 1 keeps the new model a weighted average of the sites'
    # models (tau_eff = the harmonic mean of the a_i). The paper's tau_eff = sum p_i a_i gives
    # F > 1, an extrapolation past every site's model along the slow sites' few steps: with a
    # 10x spread of steps and momentum 0.9 it sent digits to chance (benchmarks/HETERO.md).
    defaults = {"local_momentum": 0.0, "server_lr": 1.0, "max_factor": 1.0}
    needs_local_steps: ClassVar[bool] = True

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.momentum = self.param("local_momentum", lambda v: 0 <= v < 1, "a number in [0, 1)")
        self.server_lr = self.param("server_lr", lambda v: v > 0, "a positive number")
        self.max_factor = self.param("max_factor", lambda v: v >= 1, "a number >= 1")
        self._global: Mapping[str, np.ndarray] | None = None
        self._examples: list[float] = []
        self._norms: list[float] = []
        self.last_factor = 1.0

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        super().begin_round(global_weights)
        self._global = global_weights
        self._examples, self._norms = [], []

    def add(self, tensors: Mapping[str, Any], num_examples: int,
            local_steps: float | None = None) -> None:
        if local_steps is None:
            raise ValueError("fednova needs each update's local steps (train metric 'steps')")
        a = local_steps_norm(local_steps, self.momentum)
        assert self._sum is not None, "begin_round first"
        self._sum.add(tensors, fednova_weight(num_examples, a))
        self._examples.append(float(num_examples))
        self._norms.append(a)

    def finish(self) -> Weights:
        assert self._global is not None, "begin_round first"
        g = self._global
        factor = min(fednova_factor(self._examples, self._norms),
                     self.max_factor) * self.server_lr
        self.last_factor = factor
        mean = super().finish()  # M (deltas: already added to the global model)
        self._global = None
        return scaled_step(g, mean, factor)
