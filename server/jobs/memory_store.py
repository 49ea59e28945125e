"""The state store in memory (the `StateStore` of server/jobs/state.py): the same jobs, events
and round history as the SQLite `JobStore`, gone when the process ends. For tests of the job
queue and the round engine that need no disk; tests/unit/test_state_store.py runs the same
checks on both."""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import replace
from typing import Any

from fedgpu.core.bundles import BundleRef
from fedgpu.core.constants import JobState
from fedgpu.server.jobs.state import (
    MAX_EVENT_CHARS,
    MAX_EVENTS_PER_JOB,
    Event,
    JobRow,
    SavedHistory,
    StateStore,
    checked_update,
    cut,
)


class MemoryStore(StateStore):
    def __init__(self, max_events_per_job: int = MAX_EVENTS_PER_JOB) -> None:
        self.max_events_per_job = max_events_per_job
        # The SQLite store serialises calls with a lock too: the event loop and a writer
        # thread (a round's history) may call at once.
        self._lock = threading.Lock()
        self._jobs: dict[str, JobRow] = {}
        self._events: dict[str, list[Event]] = {}
        self._history: dict[str, SavedHistory] = {}

    # ---- jobs ----------------------------------------------------------------------

    def add_job(self, *, job_id: str, name: str, task: str, job_toml: str,
                job: dict[str, Any], source: str, source_sha256: str, submitted_by: str,
                rounds: int, state_dir: str, bundle: BundleRef | None = None) -> JobRow:
        with self._lock:
            if job_id in self._jobs:
                raise ValueError(f"job {job_id} exists")
            seq = max((r.seq for r in self._jobs.values()), default=0) + 1
            row = JobRow(
                job_id=job_id, seq=seq, name=name, task=task, state=JobState.QUEUED,
                reason=None, error=None, job_toml=job_toml, job=copy.deepcopy(job),
                source=source, source_sha256=source_sha256, submitted_by=submitted_by,
                submitted_at=time.time(), started_at=None, finished_at=None, rounds=rounds,
                rounds_done=0, accuracy=None, loss=None, run_id=None, state_dir=state_dir,
                bundle_sha256=bundle.sha256 if bundle is not None else None,
                bundle_size=bundle.size if bundle is not None else None,
                bundle_name=bundle.name if bundle is not None else None,
                bundle_entry=bundle.entry if bundle is not None else None)
            self._jobs[job_id] = row
            return row

    def get(self, job_id: str) -> JobRow | None:
        with self._lock:
            return self._jobs.get(job_id)

    def _ordered(self) -> list[JobRow]:
        return sorted(self._jobs.values(), key=lambda r: r.seq)

    def jobs(self, limit: int | None = None) -> list[JobRow]:
        with self._lock:
            rows = self._ordered()
        return rows if limit is None else rows[-limit:] if limit > 0 else []

    def pending(self) -> list[JobRow]:
        with self._lock:
            return [r for r in self._ordered() if not r.ended]

    def count_pending(self, besides: str | None = None) -> int:
        with self._lock:
            return sum(1 for r in self._ordered() if not r.ended and r.job_id != besides)

    def find_source(self, source: str, sha256: str) -> JobRow | None:
        with self._lock:
            found = [r for r in self._ordered()
                     if r.source == source and r.source_sha256 == sha256]
        return found[-1] if found else None

    def update(self, job_id: str, **fields: Any) -> None:
        fields = checked_update(fields)
        if "state" in fields:
            fields["state"] = JobState(fields["state"])
        with self._lock:
            row = self._jobs.get(job_id)
            if row is not None and fields:
                self._jobs[job_id] = replace(row, **fields)

    # ---- events --------------------------------------------------------------------

    def add_event(self, job_id: str, message: str, *, level: str = "info",
                  source: str = "aggregator", node: str | None = None) -> int:
        with self._lock:
            events = self._events.setdefault(job_id, [])
            seq = events[-1].seq + 1 if events else 1
            events.append(Event(seq, time.time(), level, source, node,
                                cut(message, MAX_EVENT_CHARS)))
            del events[:max(0, len(events) - self.max_events_per_job)]
            return seq

    def events(self, job_id: str, after: int = 0, limit: int = 1000) -> list[Event]:
        with self._lock:
            return [e for e in self._events.get(job_id, []) if e.seq > after][:limit]

    # ---- round history ---------------------------------------------------------------

    def save_history(self, job_id: str, history: SavedHistory) -> None:
        # A deep copy: the caller's records keep changing (late evaluations) after this.
        saved = copy.deepcopy(history)
        with self._lock:
            self._history[job_id] = saved

    def history(self, job_id: str) -> SavedHistory | None:
        with self._lock:
            saved = self._history.get(job_id)
        return None if saved is None else copy.deepcopy(saved)
