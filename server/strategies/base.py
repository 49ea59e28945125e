"""The strategy interface: how a round's accepted updates become the next global model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np

Weights = dict[str, np.ndarray]


class Strategy(ABC):
    name: str = ""

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self.params = dict(params or {})

    @abstractmethod
    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        """Prepare to receive the updates of one round."""

    @abstractmethod
    def add(self, tensors: Mapping[str, np.ndarray], num_examples: int) -> None:
        """Fold in one validated update; the caller serialises calls."""

    @abstractmethod
    def finish(self) -> Weights:
        """The new global model from what was added this round."""

    def state(self) -> dict[str, Any]:
        """JSON-able optimiser state to checkpoint (none for plain averaging)."""
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        del state
