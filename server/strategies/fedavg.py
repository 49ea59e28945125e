"""Weighted FedAvg, accumulated as updates stream in: memory is O(model) whatever K is."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedgpu.server.aggregate import WeightedSum
from fedgpu.server.strategies.base import Strategy, Weights


class FedAvg(Strategy):
    name = "fedavg"

    def __init__(self, params: Mapping[str, object] | None = None) -> None:
        super().__init__(params)
        self._sum: WeightedSum | None = None

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        self._sum = WeightedSum(global_weights)

    def add(self, tensors: Mapping[str, np.ndarray], num_examples: int) -> None:
        assert self._sum is not None, "begin_round first"
        self._sum.add(tensors, float(num_examples))

    def finish(self) -> Weights:
        assert self._sum is not None, "begin_round first"
        weights = self._sum.mean()
        self._sum = None
        return weights
