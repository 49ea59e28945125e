"""Coordinate-wise median (Yin et al., 2018): robust to fewer than half of the nodes lying."""

from __future__ import annotations

import numpy as np

from fedgpu.server.strategies.aggregate import coordinate_median
from fedgpu.server.strategies.robust import SpilledStrategy


class Median(SpilledStrategy):
    name = "median"

    def reduce(self, block: np.ndarray) -> np.ndarray:
        return coordinate_median(block)
