"""FedBuff's step (Nguyen et al. 2022): the FedAvg of one buffer of updates, each weighted by
its staleness, and the step shortened by how stale the buffer was (server/strategies/
hetero_math.py). Built by mode = "async" (server/rounds/buffered.py), not named in job files."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from fedgpu.core.hetero_config import StalenessWeighting
from fedgpu.server.strategies.base import Weights
from fedgpu.server.strategies.fedavg import FedAvg
from fedgpu.server.strategies.hetero_math import buffer_factor, staleness_weight
from fedgpu.server.strategies.scaled import scaled_step
from fedgpu.server.strategies.update import UpdateIn


class FedBuff(FedAvg):
    name = "fedbuff"
    folds_many: ClassVar[bool] = False  # each update weighs by its own staleness

    def __init__(self, weighting: StalenessWeighting = StalenessWeighting.SQRT) -> None:
        super().__init__({})
        self.weighting = weighting
        self._global: Mapping[str, np.ndarray] | None = None
        self._examples: list[float] = []
        self._weights: list[float] = []

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        super().begin_round(global_weights)
        self._global = global_weights
        self._examples, self._weights = [], []

    def add(self, update: UpdateIn) -> None:
        assert self._sum is not None, "begin_round first"
        w = staleness_weight(update.staleness, self.weighting)
        self._sum.add(update.tensors, update.num_examples * w)
        self._examples.append(float(update.num_examples))
        self._weights.append(w)

    def finish(self) -> Weights:
        assert self._global is not None, "begin_round first"
        g, self._global = self._global, None
        factor = buffer_factor(self._examples, self._weights)
        mean = super().finish()  # the staleness-weighted mean M (deltas: plus the model)
        if factor == 1.0:
            return mean  # a buffer of fresh updates: FedAvg of the buffer
        return scaled_step(g, mean, factor)
