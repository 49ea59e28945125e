"""The strategy interface: how a round's accepted updates become the next global model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from fedgpu.core.errors import ConfigError

Weights = dict[str, np.ndarray]


class Strategy(ABC):
    name: str = ""
    # Allowed [strategy_params] keys and their defaults; anything else is refused by name.
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        params = dict(params or {})
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            allowed = ", ".join(sorted(self.defaults)) or "none"
            raise ConfigError(
                f"job: [strategy_params] {', '.join(unknown)} not understood by strategy "
                f"{self.name!r} (allowed: {allowed})"
            )
        self.params = {**self.defaults, **params}

    def param(self, key: str, check: Callable[[float], bool], expected: str) -> float:
        """A numeric parameter, refused with the key and the valid range in the message."""
        value = self.params[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not check(value):
            raise ConfigError(
                f"job: [strategy_params] {key} of strategy {self.name!r} must be {expected}, "
                f"got {value!r}"
            )
        return float(value)

    @abstractmethod
    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        """Prepare to receive the updates of one round."""

    @abstractmethod
    def add(self, tensors: Mapping[str, np.ndarray], num_examples: int) -> None:
        """Fold in one validated update; the caller serialises calls."""

    @abstractmethod
    def finish(self) -> Weights:
        """The new global model from what was added this round: a proposal. State that
        carries over to later rounds changes only in commit()."""

    def pending_problem(self) -> str | None:
        """What is wrong with the state finish() proposed (e.g. a non-finite moment), if
        anything; the round is then retried and that state dropped."""
        return None

    def commit(self) -> None:  # noqa: B027 - stateless strategies have nothing to keep
        """The round's result was accepted: keep the state finish() proposed."""

    def round_report(self) -> dict[str, Any] | None:
        """What the last committed round adds to its record (central DP's spent epsilon), if
        anything; the engine stores it in the round's record under "privacy"."""
        return None

    def exhausted(self) -> str | None:
        """Why the job must end before another round (a spent privacy budget), or None."""
        return None

    def state(self) -> dict[str, Any]:
        """JSON-able optimiser state to checkpoint (none for plain averaging)."""
        return {}

    def tensor_state(self) -> dict[str, np.ndarray]:
        """Optimiser arrays to checkpoint as safetensors next to the global weights."""
        return {}

    def load_state(self, state: Mapping[str, Any],
                   tensors: Mapping[str, np.ndarray] | None = None) -> None:
        """Resume from what state() and tensor_state() returned."""
        del state, tensors
