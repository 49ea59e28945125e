"""The aggregator's state store, one interface (as Flower's `LinkState`): jobs, their events and
their round history. `JobStore` (store.py, SQLite in the state directory) is what the server
runs on; `MemoryStore` (memory_store.py) holds the same in a dict, for tests and engines that
need no disk.

What is stored where, once:

- the store: the job list, states and events, and each job's round history (the closed round
  records, the evaluation of the starting model, the refusal counters);
- the checkpoint (checkpoint.py, `<state dir>/jobs/<id>/`): the global weights and the
  engine's own state (run id, round, strategy and optimiser state, the job as parsed).

`JobCheckpoint` (job_checkpoint.py) writes and reads both for one job, so resuming reads the
checkpoint and the history as one state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedgpu.core.bundles import BundleRef
from fedgpu.core.constants import ENDED_JOB_STATES, JobState
from fedgpu.core.errors import FedgpuError

# Bounds on what one job may leave in the store, so a chatty or hostile node cannot grow it
# without limit: older events are dropped first, long messages cut with a marker.
MAX_EVENTS_PER_JOB = 20_000
MAX_EVENT_CHARS = 4_000
# The columns `update` may change; the rest of a job row is fixed at submission.
UPDATABLE = frozenset({"state", "reason", "error", "started_at", "finished_at", "rounds_done",
                       "accuracy", "loss", "run_id"})
# The keys of the engine's state that are the round history (stored in the store, not in
# the checkpoint's state.json).
HISTORY_KEYS = ("history", "initial_eval", "rejections")


class StoreError(FedgpuError):
    exit_code = 2


@dataclass(frozen=True)
class JobRow:
    job_id: str
    seq: int
    name: str
    task: str
    state: JobState
    reason: str | None
    error: str | None
    job_toml: str
    job: dict[str, Any]
    source: str
    source_sha256: str
    submitted_by: str
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    rounds: int
    rounds_done: int
    accuracy: float | None
    loss: float | None
    run_id: str | None
    state_dir: str
    # The task bundle the job came with (None: an installed task); its archive is
    # <state dir>/bundles/<bundle_sha256>.tar.
    bundle_sha256: str | None = None
    bundle_size: int | None = None
    bundle_name: str | None = None
    bundle_entry: str | None = None

    @property
    def bundle(self) -> BundleRef | None:
        if self.bundle_sha256 is None:
            return None
        return BundleRef(self.bundle_sha256, int(self.bundle_size or 0),
                         self.bundle_name or self.task, self.bundle_entry or "")

    @property
    def ended(self) -> bool:
        return self.state in ENDED_JOB_STATES

    def summary(self) -> dict[str, Any]:
        """The `fedgpu job list --json` entry (docs: reference/json.md)."""
        return {
            "job_id": self.job_id, "name": self.name, "task": self.task,
            "state": str(self.state), "reason": self.reason,
            "submitted_at": self.submitted_at, "started_at": self.started_at,
            "finished_at": self.finished_at, "rounds": self.rounds,
            "rounds_done": self.rounds_done, "accuracy": self.accuracy, "loss": self.loss,
            "error": self.error,
            "bundle_sha256": self.bundle_sha256, "bundle_size": self.bundle_size,
            "bundle_name": self.bundle_name,
        }


@dataclass(frozen=True)
class Event:
    seq: int
    time: float
    level: str
    source: str
    node: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "time": self.time, "level": self.level,
                "source": self.source, "node": self.node, "message": self.message}


@dataclass(frozen=True)
class SavedHistory:
    """A job's round history as stored: each record is `RoundRecord.to_dict()` (the
    `fedgpu rounds --json` entry), in order."""

    records: list[dict[str, Any]] = field(default_factory=list)
    initial_eval: dict[str, Any] | None = None
    rejections: dict[str, int] = field(default_factory=dict)
    # The checkpointed round this history was saved with (None: saved before the store knew
    # it, migration 0003): records of a later round belong to a round whose checkpoint was
    # never written, and are dropped on resume (`upto`).
    global_round: int | None = None

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SavedHistory:
        """The history part of an engine's state, or of a state.json written before the
        history moved into the store (it held the history under these keys)."""
        round_ = state.get("global_round")
        return cls(list(state.get("history") or []), state.get("initial_eval"),
                   dict(state.get("rejections") or {}),
                   None if round_ is None else int(round_))

    def state(self) -> dict[str, Any]:
        """As the engine's state names it (Orchestrator.restore reads these keys)."""
        return {"history": self.records, "initial_eval": self.initial_eval,
                "rejections": self.rejections}

    def upto(self, global_round: int) -> SavedHistory:
        """Without the records of rounds after the checkpoint's `global_round` (the history
        is written first, so a crash before the checkpoint leaves it one round ahead)."""
        if self.global_round is None or self.global_round <= global_round:
            return self
        kept = [r for r in self.records if int(r["round"]) <= global_round]
        return SavedHistory(kept, self.initial_eval, self.rejections, global_round)


def cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f" ...[{len(text) - limit} more characters cut]"


def checked_update(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` for `update`, the state as its stored value; ValueError for the rest."""
    bad = set(fields) - UPDATABLE
    if bad:
        raise ValueError(f"not updatable: {', '.join(sorted(bad))}")
    if "state" in fields:
        fields = {**fields, "state": JobState(fields["state"]).value}
    return fields


class StateStore(ABC):
    """Jobs, their events and their round history. Calls are short; every implementation is
    safe to call from the event loop and from one writer thread at a time."""

    max_events_per_job: int

    # ---- jobs ----------------------------------------------------------------------

    @abstractmethod
    def add_job(self, *, job_id: str, name: str, task: str, job_toml: str,
                job: dict[str, Any], source: str, source_sha256: str, submitted_by: str,
                rounds: int, state_dir: str, bundle: BundleRef | None = None) -> JobRow:
        """Queue a job (state `queued`), last in submission order."""

    @abstractmethod
    def get(self, job_id: str) -> JobRow | None: ...

    @abstractmethod
    def jobs(self, limit: int | None = None) -> list[JobRow]:
        """All jobs in submission order (the newest `limit` when given)."""

    @abstractmethod
    def pending(self) -> list[JobRow]:
        """Jobs not yet ended, oldest first: the queue (a running job first)."""

    @abstractmethod
    def count_pending(self, besides: str | None = None) -> int:
        """How many jobs are not yet ended, `besides` (a job id) not counted: the queue's
        room is a count, never a load of every waiting row."""

    @abstractmethod
    def find_source(self, source: str, sha256: str) -> JobRow | None:
        """The newest job submitted from `source` with this content, if any."""

    @abstractmethod
    def update(self, job_id: str, **fields: Any) -> None:
        """Change the `UPDATABLE` columns of a job; ValueError for any other."""

    # ---- events --------------------------------------------------------------------

    @abstractmethod
    def add_event(self, job_id: str, message: str, *, level: str = "info",
                  source: str = "aggregator", node: str | None = None) -> int:
        """Append an event (cut to MAX_EVENT_CHARS, the oldest dropped beyond
        `max_events_per_job`); its number."""

    @abstractmethod
    def events(self, job_id: str, after: int = 0, limit: int = 1000) -> list[Event]: ...

    # ---- round history ---------------------------------------------------------------

    @abstractmethod
    def save_history(self, job_id: str, history: SavedHistory) -> None:
        """Replace the job's round history whole (late evaluations change older records)."""

    @abstractmethod
    def history(self, job_id: str) -> SavedHistory | None:
        """The job's round history; None when none was saved."""

    def rejections(self, job_id: str) -> dict[str, int]:
        saved = self.history(job_id)
        return dict(saved.rejections) if saved is not None else {}

