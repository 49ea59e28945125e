"""A run's history: closed round attempts, the evaluations that land on them later, and the
refusal counters. Stored in the state store (server/jobs/state.py) with every checkpoint;
`fedgpu rounds --json` is `doc()`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from fedgpu.core.constants import RoundStatus
from fedgpu.server.rounds.records import (
    EvalEntry,
    EvalSummary,
    Rejection,
    RoundRecord,
    list_rejection,
)


class History:
    def __init__(self) -> None:
        self.records: list[RoundRecord] = []
        # The federated evaluation of the starting model (before round 1).
        self.initial_eval: EvalSummary | None = None
        self.rejections: Counter[str] = Counter()

    def append(self, record: RoundRecord) -> None:
        self.records.append(record)

    def last_of(self, number: int) -> RoundRecord | None:
        """The latest closed attempt of round `number`."""
        return next((r for r in reversed(self.records) if r.round == number), None)

    def count_rejection(self, reason: str) -> None:
        self.rejections[reason] += 1

    def file_rejection(self, entry: Rejection) -> None:
        """A refusal that answers no open task is listed under the closed round it names."""
        rec = self.last_of(entry.round) if entry.round is not None else None
        if rec is not None:
            list_rejection(rec, entry)

    def attach_eval(self, evaluated_round: int, entry: EvalEntry) -> None:
        """A node's evaluation of the global model of `evaluated_round` (0: the start)."""
        if evaluated_round <= 0:
            target = self.initial_eval = self.initial_eval or EvalSummary()
        else:
            rec = next((r for r in reversed(self.records) if r.round == evaluated_round
                        and r.status == RoundStatus.FINISHED), None)
            if rec is None:
                return
            target = rec.eval = rec.eval or EvalSummary()
        target.add(entry)

    def latest_eval(self) -> EvalSummary | None:
        return next((r.eval for r in reversed(self.records) if r.eval is not None), None)

    # ---- documents and checkpoints ---------------------------------------------------

    def doc(self, run_id: str) -> dict[str, Any]:
        """The `fedgpu rounds --json` document."""
        return {"run_id": run_id, "initial_eval": self._initial(), "rounds": self.dicts()}

    def dicts(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.records]

    def _initial(self) -> dict[str, Any] | None:
        return None if self.initial_eval is None else self.initial_eval.to_dict()

    def state(self) -> dict[str, Any]:
        """The history's part of the engine's state (the state store keeps it)."""
        return {"history": self.dicts(), "initial_eval": self._initial(),
                "rejections": dict(self.rejections)}

    def load(self, state: Mapping[str, Any]) -> None:
        """Back from the state store, or a state.json of an older version."""
        self.records = [RoundRecord.from_dict(r) for r in state.get("history") or []]
        self.initial_eval = EvalSummary.from_dict(state.get("initial_eval"))
        self.rejections = Counter(state.get("rejections") or {})
