"""Shared policy of the strategies that need every update: spill, then reduce slice-wise."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.server.strategies.base import Strategy, Weights
from fedgpu.server.strategies.spill import UpdateSpill
from fedgpu.server.strategies.update import UpdateIn


class SpilledStrategy(Strategy):
    """Unweighted by design: a robust statistic must not let one node's claimed example count
    outvote the others."""

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        # The row's memory_budget_mib and spill_dir (typed and ranged by the table).
        self.budget_bytes = int(self.number("memory_budget_mib") * (1 << 20))
        self.spill_dir = str(self.params["spill_dir"]) or None
        self._spill: UpdateSpill | None = None

    def reduce(self, block: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        # A retried round starts over: the previous attempt's files go.
        if self._spill is not None:
            self._spill.cleanup()
        self._spill = UpdateSpill(global_weights, self.spill_dir)

    def add(self, update: UpdateIn) -> None:
        assert self._spill is not None, "begin_round first"
        self._spill.write(update.tensors)

    def finish(self) -> Weights:
        assert self._spill is not None, "begin_round first"
        try:
            return self._spill.reduce(self.reduce, self.budget_bytes)
        finally:
            self._spill.cleanup()
            self._spill = None
