"""The aggregator's durable state: jobs, their events and round history, in SQLite.

One database file in the state directory (`fedgpu.db`), WAL mode so readers (admin queries,
the dashboard) never wait for the writer. `synchronous=NORMAL`: a committed change survives
the aggregator being killed at any moment (SIGKILL, OOM); after a power cut the last few
events may be lost, never the database. A round's weights are fsynced by the checkpointer,
whose state.json stays the commit point the job resumes from. Migrations are the numbered files in
migrations/ applied in order; `PRAGMA user_version` records the last one applied, so an older
aggregator refuses a database a newer one has changed.

Calls are short and serialised by one lock: the event loop calls them directly for small
rows; whole round histories are written from a thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fedgpu.core.bundles import BundleRef
from fedgpu.core.constants import ENDED_JOB_STATES, JobState
from fedgpu.core.errors import FedgpuError

DB_FILE = "fedgpu.db"
# Bounds on what one job may leave in the database, so a chatty or hostile node cannot grow
# it without limit: older events are dropped first, long messages cut with a marker.
MAX_EVENTS_PER_JOB = 20_000
MAX_EVENT_CHARS = 4_000


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
        """The `fedgpu job list --json` entry (README: Jobs)."""
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


def _migrations() -> list[tuple[int, str]]:
    folder = resources.files("fedgpu.server.jobs").joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            found.append((int(entry.name.split("_", 1)[0]), entry.read_text()))
    return sorted(found)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f" ...[{len(text) - limit} more characters cut]"


class JobStore:
    def __init__(self, directory: Path, max_events_per_job: int = MAX_EVENTS_PER_JOB) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.max_events_per_job = max_events_per_job
        self.path = directory / DB_FILE
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None,
                                       check_same_thread=False, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot open the job database {self.path}: {exc}; move it "
                             "aside to start with an empty job list") from None

    def _migrate(self) -> None:
        current = self._db.execute("PRAGMA user_version").fetchone()[0]
        known = _migrations()
        newest = known[-1][0] if known else 0
        if current > newest:
            raise StoreError(f"{self.path} was written by a newer fedgpu (schema {current}, "
                             f"this one knows {newest}); upgrade fedgpu")
        for number, sql in known:
            if number <= current:
                continue
            with self._tx():
                self._db.executescript("BEGIN;" + sql + f";PRAGMA user_version={number};"
                                       "COMMIT;")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._db

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- jobs ----------------------------------------------------------------------

    def add_job(self, *, job_id: str, name: str, task: str, job_toml: str,
                job: dict[str, Any], source: str, source_sha256: str, submitted_by: str,
                rounds: int, state_dir: str, bundle: BundleRef | None = None) -> JobRow:
        now = time.time()
        with self._tx() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
                db.execute(
                    "INSERT INTO jobs (job_id, seq, name, task, state, job_toml, job_json, "
                    "source, source_sha256, submitted_by, submitted_at, rounds, state_dir, "
                    "bundle_sha256, bundle_size, bundle_name, bundle_entry) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (job_id, seq, name, task, JobState.QUEUED.value, job_toml,
                     json.dumps(job), source, source_sha256, submitted_by, now, rounds,
                     state_dir, *((bundle.sha256, bundle.size, bundle.name, bundle.entry)
                                  if bundle is not None else (None,) * 4)))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        row = self.get(job_id)
        assert row is not None
        return row

    _COLUMNS = ("job_id, seq, name, task, state, reason, error, job_toml, job_json, source, "
                "source_sha256, submitted_by, submitted_at, started_at, finished_at, rounds, "
                "rounds_done, accuracy, loss, run_id, state_dir, bundle_sha256, bundle_size, "
                "bundle_name, bundle_entry")

    @staticmethod
    def _row(r: Sequence[Any]) -> JobRow:
        values = list(r)
        values[4] = JobState(values[4])
        values[8] = json.loads(values[8])
        return JobRow(*values)

    def get(self, job_id: str) -> JobRow | None:
        with self._tx() as db:
            r = db.execute(f"SELECT {self._COLUMNS} FROM jobs WHERE job_id = ?",
                           (job_id,)).fetchone()
        return None if r is None else self._row(r)

    def jobs(self, limit: int | None = None) -> list[JobRow]:
        """All jobs in submission order (the newest `limit` when given)."""
        with self._tx() as db:
            if limit is None:
                rows = db.execute(f"SELECT {self._COLUMNS} FROM jobs ORDER BY seq").fetchall()
            else:
                rows = db.execute(f"SELECT {self._COLUMNS} FROM jobs ORDER BY seq DESC "
                                  "LIMIT ?", (limit,)).fetchall()[::-1]
        return [self._row(r) for r in rows]

    def pending(self) -> list[JobRow]:
        """Jobs not yet ended, oldest first: the queue (a running job first)."""
        with self._tx() as db:
            rows = db.execute(
                f"SELECT {self._COLUMNS} FROM jobs WHERE state NOT IN (?, ?, ?) ORDER BY seq",
                tuple(s.value for s in ENDED_JOB_STATES)).fetchall()
        return [self._row(r) for r in rows]

    def find_source(self, source: str, sha256: str) -> JobRow | None:
        """The newest job submitted from `source` with this content, if any."""
        with self._tx() as db:
            r = db.execute(f"SELECT {self._COLUMNS} FROM jobs WHERE source = ? AND "
                           "source_sha256 = ? ORDER BY seq DESC LIMIT 1",
                           (source, sha256)).fetchone()
        return None if r is None else self._row(r)

    def update(self, job_id: str, **fields: Any) -> None:
        allowed = {"state", "reason", "error", "started_at", "finished_at", "rounds_done",
                   "accuracy", "loss", "run_id"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"not updatable: {', '.join(sorted(bad))}")
        if not fields:
            return
        if "state" in fields:
            fields["state"] = JobState(fields["state"]).value
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as db:
            db.execute(f"UPDATE jobs SET {cols} WHERE job_id = ?", (*fields.values(), job_id))

    # ---- events --------------------------------------------------------------------

    def add_event(self, job_id: str, message: str, *, level: str = "info",
                  source: str = "aggregator", node: str | None = None) -> int:
        with self._tx() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM job_events WHERE "
                                 "job_id = ?", (job_id,)).fetchone()[0]
                db.execute("INSERT INTO job_events VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (job_id, seq, time.time(), level, source, node,
                            _cut(message, MAX_EVENT_CHARS)))
                if seq > self.max_events_per_job:
                    db.execute("DELETE FROM job_events WHERE job_id = ? AND seq <= ?",
                               (job_id, seq - self.max_events_per_job))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return int(seq)

    def events(self, job_id: str, after: int = 0, limit: int = 1000) -> list[Event]:
        with self._tx() as db:
            rows = db.execute("SELECT seq, time, level, source, node, message FROM job_events "
                              "WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                              (job_id, after, limit)).fetchall()
        return [Event(*r) for r in rows]

    # ---- round history ---------------------------------------------------------------

    def save_history(self, job_id: str, history: Sequence[dict[str, Any]],
                     initial_eval: dict[str, Any] | None,
                     rejections: dict[str, int] | None = None) -> None:
        """Replace the job's round history (late evaluations change older records)."""
        rows = [(job_id, i, int(rec["round"]), str(rec["status"]), json.dumps(rec))
                for i, rec in enumerate(history)]
        with self._tx() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM job_rounds WHERE job_id = ?", (job_id,))
                db.executemany("INSERT INTO job_rounds VALUES (?, ?, ?, ?, ?)", rows)
                db.execute("INSERT INTO job_meta (job_id, initial_eval, rejections) VALUES "
                           "(?, ?, ?) ON CONFLICT(job_id) DO UPDATE SET initial_eval = "
                           "excluded.initial_eval, rejections = excluded.rejections",
                           (job_id, json.dumps(initial_eval), json.dumps(rejections or {})))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def history(self, job_id: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        with self._tx() as db:
            rows = db.execute("SELECT record_json FROM job_rounds WHERE job_id = ? ORDER BY "
                              "idx", (job_id,)).fetchall()
            meta = db.execute("SELECT initial_eval FROM job_meta WHERE job_id = ?",
                              (job_id,)).fetchone()
        return [json.loads(r[0]) for r in rows], (json.loads(meta[0]) if meta else None)

    def rejections(self, job_id: str) -> dict[str, int]:
        with self._tx() as db:
            meta = db.execute("SELECT rejections FROM job_meta WHERE job_id = ?",
                              (job_id,)).fetchone()
        return json.loads(meta[0]) if meta and meta[0] else {}
