"""Coordinate-wise trimmed mean: drop the floor(trim*K) lowest and highest values per weight."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.server.strategies.aggregate import trimmed_mean
from fedgpu.server.strategies.robust import SpilledStrategy


class TrimmedMean(SpilledStrategy):
    name = "trimmed_mean"
    defaults = {**SpilledStrategy.defaults, "trim": 0.1}

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.trim = self.param("trim", lambda v: 0 <= v < 0.5, "a number in [0, 0.5)")

    def reduce(self, block: np.ndarray) -> np.ndarray:
        return trimmed_mean(block, self.trim)
