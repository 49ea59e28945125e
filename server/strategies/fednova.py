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
from fedgpu.server.strategies.update import UpdateIn


class FedNova(FedAvg):
    name = "fednova"
    # local_momentum: the momentum of the sites' SGD (the built-in tasks use 0.9); it sets how
    # many gradients tau steps add up to. server_lr scales the normalised step. max_factor caps
    # F (hetero_math.fednova_factor): 1 keeps the new model a weighted average of the sites'
    # models (tau_eff = the harmonic mean of the a_i). The paper's tau_eff = sum p_i a_i gives
    # F > 1, an extrapolation past every site's model along the slow sites' few steps: with a
    # 10x spread of steps and momentum 0.9 it sent digits to chance (benchmarks/HETERO.md).
    folds_many: ClassVar[bool] = False  # each update weighs by its own local steps

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.momentum = self.number("local_momentum")
        self.server_lr = self.number("server_lr")
        self.max_factor = self.number("max_factor")
        self._global: Mapping[str, np.ndarray] | None = None
        self._examples: list[float] = []
        self._norms: list[float] = []
        self.last_factor = 1.0

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        super().begin_round(global_weights)
        self._global = global_weights
        self._examples, self._norms = [], []

    def add(self, update: UpdateIn) -> None:
        if update.local_steps is None:
            raise ValueError("fednova needs each update's local steps (train metric 'steps')")
        a = local_steps_norm(update.local_steps, self.momentum)
        assert self._sum is not None, "begin_round first"
        self._sum.add(update.tensors, fednova_weight(update.num_examples, a))
        self._examples.append(float(update.num_examples))
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
