"""Shared policy of the strategies that need every update: spill, then reduce slice-wise."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.core.errors import ConfigError
from fedgpu.server.strategies.base import Strategy, Weights
from fedgpu.server.strategies.spill import UpdateSpill


class SpilledStrategy(Strategy):
    """Unweighted by design: a robust statistic must not let one node's claimed example count
    outvote the others."""

    defaults: dict[str, Any] = {"memory_budget_mib": 256, "spill_dir": ""}

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        budget = self.param("memory_budget_mib", lambda v: v >= 1, "at least 1 (MiB)")
        self.budget_bytes = int(budget * (1 << 20))
        spill_dir = self.params["spill_dir"]
        if not isinstance(spill_dir, str):
            raise ConfigError(
                f"job: [strategy_params] spill_dir must be a directory path, got {spill_dir!r}")
        self.spill_dir = spill_dir or None
        self._spill: UpdateSpill | None = None

    def reduce(self, block: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        # A retried round starts over: the previous attempt's files go.
        if self._spill is not None:
            self._spill.cleanup()
        self._spill = UpdateSpill(global_weights, self.spill_dir)

    def add(self, tensors: Mapping[str, np.ndarray], num_examples: int) -> None:
        assert self._spill is not None, "begin_round first"
        self._spill.write(tensors)

    def finish(self) -> Weights:
        assert self._spill is not None, "begin_round first"
        try:
            return self._spill.reduce(self.reduce, self.budget_bytes)
        finally:
            self._spill.cleanup()
            self._spill = None
