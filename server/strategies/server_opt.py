"""Server optimisers: FedAvg's streamed mean, then an optimiser step on the pseudo-gradient
(global - mean), with its state (named arrays) checkpointed beside the global weights."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.server.strategies.base import Weights
from fedgpu.server.strategies.fedavg import FedAvg


class ServerOptimizer(FedAvg):
    # Each named slot is a dict of arrays keyed like the model, saved as "<slot>/<tensor>".
    slots: tuple[str, ...] = ()

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.arrays: dict[str, dict[str, np.ndarray]] = {s: {} for s in self.slots}
        self.steps = 0
        self._global: Mapping[str, np.ndarray] | None = None
        self._pending: dict[str, dict[str, np.ndarray]] | None = None

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        super().begin_round(global_weights)
        self._global = global_weights
        self._pending = None

    def finish(self) -> Weights:
        assert self._global is not None, "begin_round first"
        # The step works on copies: a round whose result is refused (not finite) is retried
        # from the moments as they were, not from ones that already took its step.
        pending = {slot: {k: a.copy() for k, a in named.items()}
                   for slot, named in self.arrays.items()}
        # Overflow is looked for afterwards (pending_problem and the engine's finite check);
        # numpy's warnings about it would only be noise in the log.
        with np.errstate(over="ignore", invalid="ignore"):
            new = self.step(self._global, super().finish(), pending)
        self._pending = pending
        self._global = None
        return new

    def pending_problem(self) -> str | None:
        for slot, named in (self._pending or {}).items():
            for name, arr in named.items():
                if not np.isfinite(arr).all():
                    return f"optimiser state {slot}/{name} is not finite"
        return None

    def commit(self) -> None:
        if self._pending is not None:
            self.arrays, self._pending = self._pending, None
            self.steps += 1

    @abstractmethod
    def step(self, global_weights: Mapping[str, np.ndarray], mean: Weights,
             arrays: dict[str, dict[str, np.ndarray]]) -> Weights:
        """The new global model from the old one and this round's weighted mean, updating
        the optimiser `arrays` (a copy of the committed ones) in place."""

    def state(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def tensor_state(self) -> dict[str, np.ndarray]:
        return {f"{slot}/{k}": a for slot, named in self.arrays.items() for k, a in named.items()}

    def load_state(self, state: Mapping[str, Any],
                   tensors: Mapping[str, np.ndarray] | None = None) -> None:
        self.steps = int(state.get("steps", 0))
        for slot in self.slots:
            prefix = f"{slot}/"
            # Copies: checkpoint tensors may be read-only views of a file's bytes.
            self.arrays[slot] = {k[len(prefix):]: np.array(v) for k, v in (tensors or {}).items()
                                 if k.startswith(prefix)}
