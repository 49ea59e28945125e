"""Coordinate-wise trimmed mean: drop the floor(trim*K) lowest and highest values per weight."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.server.strategies.aggregate import trimmed_mean
from fedgpu.server.strategies.robust import SpilledStrategy


class TrimmedMean(SpilledStrategy):
    name = "trimmed_mean"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.trim = self.number("trim")

    def reduce(self, block: np.ndarray) -> np.ndarray:
        return trimmed_mean(block, self.trim)
