"""One job's checkpoint, split once between its two homes: the round history goes to the state
store (server/jobs/state.py), the weights and the engine's own state to the checkpoint
directory (server/rounds/checkpoint.py, state.json). Resuming reads both back as one state.

The engine (server/rounds/engine.py) hands its whole state to `save` and gets it back from
`load`; it does not know where each part lives.

Order of the writes, so a crash at any moment resumes correctly:
1. the history, with the round it goes with (the store makes it durable before returning);
2. the weights and state.json (the checkpoint's own commit point);
3. the job's progress in the job list (rounds done, latest accuracy and loss).
A crash between 1 and 2 leaves the history one round ahead of the checkpoint: `load` drops the
records of that round, which then runs again.

A state.json written before the history moved into the store (it holds `history`) is read as
it is: its history is the one that went with its weights, and is written into the store on
load; the next checkpoint leaves it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.server.jobs.state import HISTORY_KEYS, SavedHistory, StateStore
from fedgpu.server.rounds.checkpoint import Checkpointer, SavedWeights


def engine_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The part of an engine's state that the checkpoint keeps (all but the history)."""
    return {k: v for k, v in state.items() if k not in HISTORY_KEYS}


def latest_eval(records: list[dict[str, Any]]) -> dict[str, Any]:
    return next((r["eval"] for r in reversed(records) if r.get("eval")), None) or {}


class JobCheckpoint(Checkpointer):
    """The checkpointer an Orchestrator of a job is given."""

    def __init__(self, directory: Path, store: StateStore, job_id: str) -> None:
        super().__init__(directory)
        self.store = store
        self.job_id = job_id

    def save(self, weights: Mapping[str, np.ndarray], state: Mapping[str, Any],
             tensors: Mapping[str, np.ndarray] | None = None,
             same_as: SavedWeights | None = None) -> SavedWeights:
        history = SavedHistory.from_state(state)
        self.store.save_history(self.job_id, history)
        saved = super().save(weights, engine_state(state), tensors, same_as)
        latest = latest_eval(history.records)
        self.store.update(self.job_id, rounds_done=int(state.get("global_round", 0)),
                          accuracy=latest.get("accuracy"), loss=latest.get("loss"),
                          run_id=str(state.get("run_id")))
        return saved

    def load(self) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """The checkpoint's weights and the engine's state with the job's history in it."""
        loaded = super().load()
        if loaded is None:
            return None
        weights, state = loaded
        if "history" in state:
            # Written before the store held the history: this copy went with these weights.
            history = SavedHistory.from_state(state)
            self.store.save_history(self.job_id, history)
        else:
            history = self.store.history(self.job_id) or SavedHistory()
            history = history.upto(int(state.get("global_round", 0)))
        return weights, {**engine_state(state), **history.state()}
