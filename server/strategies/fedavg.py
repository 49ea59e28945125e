"""Weighted FedAvg, accumulated as updates stream in: memory is O(model) whatever K is."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import numpy as np

from fedgpu.server.strategies.aggregate import WeightedSum
from fedgpu.server.strategies.base import Strategy, Weights
from fedgpu.server.strategies.update import UpdateIn


class FedAvg(Strategy):
    name = "fedavg"
    folds_many: ClassVar[bool] = True
    # Applied to the mean before anything reads it, server optimisers included: central DP's
    # noise (server/strategies/private.py).
    mean_hook: Callable[[Weights], Weights] | None = None

    def __init__(self, params: Mapping[str, object] | None = None) -> None:
        super().__init__(params)
        self._sum: WeightedSum | None = None
        # The last round's accumulator: its mean became the global model, which the engine then
        # holds as views of its checkpoint file, so its memory (already faulted in) takes the
        # next round's sum. Without a checkpoint the mean itself stays the global model: then
        # it shares memory with it and is not reused (begin_round checks). One spare only: a
        # multi-GB model's spare is a model's worth of memory held between rounds.
        self._spares: list[dict[str, np.ndarray]] = []
        # Updates are deltas from the global model (a job's update_codec): the mean is then
        # added to the global model, in the same pass that finishes the mean.
        self.deltas = False
        self._base: Mapping[str, np.ndarray] | None = None

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        live = [a for a in global_weights.values() if isinstance(a, np.ndarray)]
        reuse = next((s for s in self._spares
                      if not any(np.may_share_memory(x, g) for x in s.values() for g in live)),
                     None)
        self._sum = WeightedSum(global_weights, reuse)
        self._base = global_weights if self.deltas else None
        if reuse is not None:
            self._spares.remove(reuse)

    def add(self, update: UpdateIn) -> None:
        assert self._sum is not None, "begin_round first"
        self._sum.add(update.tensors, float(update.num_examples))

    def add_many(self, updates: Sequence[UpdateIn]) -> None:
        """Several updates that arrived together, in one sweep over the sum."""
        assert self._sum is not None, "begin_round first"
        self._sum.add_many([(u.tensors, float(u.num_examples)) for u in updates])

    def finish(self) -> Weights:
        assert self._sum is not None, "begin_round first"
        weights = self._sum.mean(offset=self._base)
        if self.mean_hook is not None:
            weights = self.mean_hook(weights)
        self._sum, self._base = None, None
        self._spares = [{k: v for k, v in weights.items()
                         if isinstance(v, np.ndarray) and v.flags.owndata}]
        return weights
