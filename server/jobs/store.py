"""The aggregator's state store in SQLite (the `StateStore` of server/jobs/state.py): jobs,
their events and their round history, the only copy of it.

One database file in the state directory (`fedgpu.db`), WAL mode so readers (admin queries,
the dashboard) never wait for the writer. `synchronous=NORMAL`: a committed change survives
the aggregator being killed at any moment (SIGKILL, OOM); after a power cut the last few
events may be lost, never the database. A round's history is written with
`synchronous=FULL`, before the checkpoint of its weights (server/jobs/job_checkpoint.py), so
a checkpoint never names a round the history lacks. Migrations are the numbered files in
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
from importlib import resources
from pathlib import Path
from typing import Any

from fedgpu.core.bundles import BundleRef
from fedgpu.core.constants import ENDED_JOB_STATES, JobState
from fedgpu.server.jobs.state import (
    MAX_EVENT_CHARS,
    MAX_EVENTS_PER_JOB,
    Event,
    JobRow,
    SavedHistory,
    StateStore,
    StoreError,
    checked_update,
    cut,
)

# The records of the interface, importable from here as before.
__all__ = ["DB_FILE", "Event", "JobRow", "JobStore", "StoreError", "read_history"]

DB_FILE = "fedgpu.db"


def _migrations() -> list[tuple[int, str]]:
    folder = resources.files("fedgpu.server.jobs").joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            found.append((int(entry.name.split("_", 1)[0]), entry.read_text()))
    return sorted(found)


class JobStore(StateStore):
    """The state store in SQLite: what the aggregator runs on."""

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

    def count_pending(self, besides: str | None = None) -> int:
        with self._tx() as db:
            return int(db.execute(
                "SELECT COUNT(*) FROM jobs WHERE state NOT IN (?, ?, ?) AND job_id IS NOT ?",
                (*(s.value for s in ENDED_JOB_STATES), besides)).fetchone()[0])

    def find_source(self, source: str, sha256: str) -> JobRow | None:
        """The newest job submitted from `source` with this content, if any."""
        with self._tx() as db:
            r = db.execute(f"SELECT {self._COLUMNS} FROM jobs WHERE source = ? AND "
                           "source_sha256 = ? ORDER BY seq DESC LIMIT 1",
                           (source, sha256)).fetchone()
        return None if r is None else self._row(r)

    def update(self, job_id: str, **fields: Any) -> None:
        fields = checked_update(fields)
        if not fields:
            return
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
                            cut(message, MAX_EVENT_CHARS)))
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

    def save_history(self, job_id: str, history: SavedHistory) -> None:
        rows = [(job_id, i, int(rec["round"]), str(rec["status"]), json.dumps(rec))
                for i, rec in enumerate(history.records)]
        with self._tx() as db:
            # Durable on return even across a power cut: the checkpoint written next relies
            # on it (WAL + FULL syncs the log at commit).
            db.execute("PRAGMA synchronous=FULL")
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM job_rounds WHERE job_id = ?", (job_id,))
                db.executemany("INSERT INTO job_rounds VALUES (?, ?, ?, ?, ?)", rows)
                db.execute("INSERT INTO job_meta (job_id, initial_eval, rejections, "
                           "history_round) VALUES (?, ?, ?, ?) ON CONFLICT(job_id) DO UPDATE "
                           "SET initial_eval = excluded.initial_eval, rejections = "
                           "excluded.rejections, history_round = excluded.history_round",
                           (job_id, json.dumps(history.initial_eval),
                            json.dumps(history.rejections), history.global_round))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            finally:
                db.execute("PRAGMA synchronous=NORMAL")

    def history(self, job_id: str) -> SavedHistory | None:
        with self._tx() as db:
            return _history(db, job_id)


def _history(db: sqlite3.Connection, job_id: str) -> SavedHistory | None:
    rows = db.execute("SELECT record_json FROM job_rounds WHERE job_id = ? ORDER BY idx",
                      (job_id,)).fetchall()
    try:
        meta = db.execute("SELECT initial_eval, rejections, history_round FROM job_meta "
                          "WHERE job_id = ?", (job_id,)).fetchone()
    except sqlite3.OperationalError:
        # A database from before migration 0003, read without migrating it (`read_history`).
        meta = db.execute("SELECT initial_eval, rejections, NULL FROM job_meta WHERE "
                          "job_id = ?", (job_id,)).fetchone()
    if meta is None and not rows:
        return None
    initial, rejections, round_ = meta if meta is not None else (None, None, None)
    return SavedHistory([json.loads(r[0]) for r in rows],
                        json.loads(initial) if initial else None,
                        json.loads(rejections) if rejections else {}, round_)


def read_history(state_dir: Path, job_id: str) -> SavedHistory | None:
    """A job's history from the database of `state_dir`, opened read-only (`fedgpu report`
    reads it beside a running aggregator, and must never migrate or lock it)."""
    path = state_dir / DB_FILE
    if not path.exists():
        return None
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        try:
            return _history(db, job_id)
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"cannot read the job database {path}: {exc}") from None
