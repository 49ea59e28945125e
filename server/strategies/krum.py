"""Krum (Blanchard et al. 2017): the update closest to its neighbours, or with
num_clients_to_keep > 0 the mean of that many best (Multi-Krum), as Flower's Krum
(flwr/server/strategy/krum.py: the same parameters, defaults and results; the arithmetic is in
krum_math.py).

Scores need the distance between every pair of updates. The updates are spilled to disk as
they arrive like the other robust strategies' (spill.py), and the distances summed slice by
slice into a K x K matrix within memory_budget_mib: the aggregator never holds K models. The
kept updates are then read back slice by slice for their mean. Choosing is unweighted (a
claimed example count cannot buy a place); the mean of the kept ones weighs them by examples,
as Flower does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.server.strategies.base import Weights
from fedgpu.server.strategies.krum_math import (
    add_gram,
    krum_scores,
    krum_select,
    selected_mean_weights,
    squared_distances,
)
from fedgpu.server.strategies.robust import SpilledStrategy
from fedgpu.server.strategies.update import UpdateIn


class Krum(SpilledStrategy):
    name = "krum"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.num_malicious = int(self.params["num_malicious_clients"])
        # 0 (Krum's default): the single best update, which the mean of one is.
        self.keep = max(1, int(self.params["num_clients_to_keep"]))
        self._global: Mapping[str, np.ndarray] | None = None
        self._examples: list[float] = []
        self.last_selected: list[int] = []  # the kept updates of the last round, best first

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        super().begin_round(global_weights)
        self._global = global_weights
        self._examples = []

    def add(self, update: UpdateIn) -> None:
        super().add(update)
        self._examples.append(float(update.num_examples))

    def finish(self) -> Weights:
        spill, g = self._spill, self._global
        assert spill is not None and g is not None, "begin_round first"
        try:
            k = spill.count
            if k == 0:
                raise ValueError("no updates were added")
            gram = np.zeros((k, k))
            flat = {name: np.asarray(a).reshape(-1) for name, a in g.items()}

            def visit(name: str, start: int, block: np.ndarray) -> None:
                add_gram(gram, block, flat[name][start : start + block.shape[1]])

            # A slice's float64 copy in add_gram may be twice the slice: a third each.
            spill.scan(visit, max(1, self.budget_bytes // 3))
            chosen = krum_select(krum_scores(squared_distances(gram), self.num_malicious),
                                 self.keep)
            weights = selected_mean_weights(np.array(self._examples), chosen)[chosen]
            self.last_selected = chosen.tolist()
            return spill.reduce(lambda block: weights @ block, self.budget_bytes, rows=chosen)
        finally:
            spill.cleanup()
            self._spill, self._global = None, None
