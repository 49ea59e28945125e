"""The strategy interface: how a round's accepted updates become the next global model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from fedgpu.core.job.strategies import STRATEGY_SPECS, Scalar, StrategySpec, UpdateNeed
from fedgpu.server.strategies.update import UpdateIn

Weights = dict[str, np.ndarray]


class Strategy(ABC):
    """A strategy is built from its row of the strategy table (fedgpu/core/job/strategies.py):
    the row names and checks its [strategy_params] and says what each update must carry."""

    # The table row's name; the class is registered under it (server/strategies/__init__.py).
    name: ClassVar[str] = ""
    # add_many(updates) folds several updates in one sweep. Used only where the row needs
    # nothing but examples (server/rounds/work.py), so a class whose add reads more, or does
    # more than add to a weighted sum, sets it False.
    folds_many: ClassVar[bool] = False

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self.spec: StrategySpec = STRATEGY_SPECS[self.name]
        # Checked, typed, aliases mapped to Flower's names, defaults filled in: the table is
        # the one place that knows them.
        self.params: dict[str, Scalar] = self.spec.parse_params(params or {}, "job")

    @property
    def needs(self) -> frozenset[UpdateNeed]:
        """What each update must carry besides its tensors (the row's `needs`)."""
        return self.spec.needs

    def number(self, key: str) -> float:
        """A numeric parameter (checked against its range by the table already)."""
        return float(self.params[key])  # type: ignore[arg-type]

    @abstractmethod
    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        """Prepare to receive the updates of one round."""

    @abstractmethod
    def add(self, update: UpdateIn) -> None:
        """Fold in one validated update; the caller serialises calls."""

    def add_many(self, updates: Sequence[UpdateIn]) -> None:
        """Several updates that arrived together (only where folds_many is True)."""
        raise NotImplementedError(f"strategy {self.name!r} folds updates one at a time")

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
