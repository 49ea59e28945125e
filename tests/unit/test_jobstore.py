"""The job database: order, states, events with bounds, reopening, migrations. What every state
store does (the memory one too) is in test_state_store.py."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fedgpu.core.constants import JobState
from fedgpu.server.jobs import store as jobstore
from fedgpu.server.jobs.store import JobStore, StoreError


def _add(store: JobStore, job_id: str, task: str = "digits") -> jobstore.JobRow:
    return store.add_job(job_id=job_id, name=f"n-{job_id}", task=task, job_toml="x",
                         job={"task": task, "rounds": 3}, source="submit",
                         source_sha256="abc", submitted_by="operator", rounds=3,
                         state_dir=f"jobs/{job_id}")


def test_jobs_keep_submission_order_and_survive_reopening(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    for jid in ("b", "a", "c"):
        _add(store, jid)
    store.update("b", state=JobState.RUNNING, started_at=1.0)
    store.update("a", state=JobState.FINISHED, rounds_done=3, accuracy=0.9)
    store.close()
    again = JobStore(tmp_path)
    assert [j.job_id for j in again.jobs()] == ["b", "a", "c"]
    assert [j.job_id for j in again.pending()] == ["b", "c"]
    a = again.get("a")
    assert a is not None and a.state is JobState.FINISHED and a.ended
    assert a.summary()["accuracy"] == 0.9 and a.job == {"task": "digits", "rounds": 3}
    assert again.get("missing") is None
    assert [j.job_id for j in again.jobs(limit=2)] == ["a", "c"]


def test_update_refuses_unknown_columns(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    _add(store, "a")
    with pytest.raises(ValueError, match="job_toml"):
        store.update("a", job_toml="evil")
    with pytest.raises(ValueError):
        store.update("a", state="exploded")


def test_events_are_numbered_cut_and_bounded(tmp_path: Path) -> None:
    store = JobStore(tmp_path, max_events_per_job=5)
    _add(store, "a")
    for i in range(8):
        store.add_event("a", f"event {i}")
    seqs = [e.seq for e in store.events("a")]
    assert seqs == [4, 5, 6, 7, 8]
    assert [e.seq for e in store.events("a", after=6)] == [7, 8]
    seq = store.add_event("a", "x" * 10_000, level="error", source="node", node="site-a")
    last = store.events("a", after=seq - 1)[0]
    assert len(last.message) < 5_000 and "more characters cut" in last.message
    assert (last.level, last.source, last.node) == ("error", "node", "site-a")


def test_a_database_from_a_newer_fedgpu_is_refused(tmp_path: Path) -> None:
    JobStore(tmp_path).close()
    with sqlite3.connect(tmp_path / jobstore.DB_FILE) as db:
        db.execute("PRAGMA user_version = 999")
    with pytest.raises(StoreError, match="newer fedgpu"):
        JobStore(tmp_path)


def test_a_damaged_database_is_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / jobstore.DB_FILE).write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="move it aside"):
        JobStore(tmp_path)


def test_a_database_before_bundles_is_migrated_and_bundles_round_trip(tmp_path: Path) -> None:
    from importlib import resources

    from fedgpu.core.bundles import BundleRef

    # A database as the first schema left it, with a job in it.
    first = resources.files("fedgpu.server.jobs").joinpath("migrations/0001_jobs.sql").read_text()
    with sqlite3.connect(tmp_path / jobstore.DB_FILE) as db:
        db.executescript(first + ";PRAGMA user_version=1;")
        db.execute("INSERT INTO jobs (job_id, seq, name, task, state, job_toml, job_json, "
                   "source, source_sha256, submitted_by, submitted_at, rounds, state_dir) "
                   "VALUES ('old', 1, 'n', 'digits', 'finished', 'x', '{}', 'submit', 'a', "
                   "'op', 1.0, 3, 'jobs/old')")
    store = JobStore(tmp_path)
    old = store.get("old")
    assert old is not None and old.bundle is None
    assert old.summary()["bundle_sha256"] is None
    ref = BundleRef("ab" * 32, 10240, "demo", "demo_task.task:DemoTask")
    store.add_job(job_id="new", name="demo", task="demo", job_toml="x", job={}, source="submit",
                  source_sha256="b", submitted_by="op", rounds=2, state_dir="jobs/new",
                  bundle=ref)
    store.close()
    new = JobStore(tmp_path).get("new")
    assert new is not None and new.bundle == ref
    assert {k: new.summary()[k] for k in ("bundle_sha256", "bundle_size", "bundle_name")} == {
        "bundle_sha256": ref.sha256, "bundle_size": 10240, "bundle_name": "demo"}


def test_a_database_with_history_before_0003_is_migrated_and_keeps_it(tmp_path: Path) -> None:
    # A database as the aggregator left it before the history was stored only here: its
    # rows name no round, and keep being read (the checkpoint's state.json decides).
    from importlib import resources

    folder = resources.files("fedgpu.server.jobs").joinpath("migrations")
    with sqlite3.connect(tmp_path / jobstore.DB_FILE) as db:
        for name in ("0001_jobs.sql", "0002_bundles.sql"):
            db.executescript(folder.joinpath(name).read_text())
        db.execute("PRAGMA user_version=2")
        db.execute("INSERT INTO jobs (job_id, seq, name, task, state, job_toml, job_json, "
                   "source, source_sha256, submitted_by, submitted_at, rounds, state_dir) "
                   "VALUES ('old', 1, 'n', 'digits', 'running', 'x', '{}', 'submit', 'a', "
                   "'op', 1.0, 3, 'jobs/old')")
        db.execute("INSERT INTO job_rounds VALUES ('old', 0, 1, 'finished', "
                   "'{\"round\": 1, \"status\": \"finished\"}')")
        db.execute("INSERT INTO job_meta VALUES ('old', '{\"loss\": 2.0}', '{\"digest\": 1}')")
    # Read-only (as `fedgpu report` reads it) before any migration ...
    before = jobstore.read_history(tmp_path, "old")
    assert before is not None and before.global_round is None
    with sqlite3.connect(tmp_path / jobstore.DB_FILE) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
    # ... and after it, the same.
    store = JobStore(tmp_path)
    saved = store.history("old")
    assert saved == before
    assert saved.records == [{"round": 1, "status": "finished"}]
    assert saved.initial_eval == {"loss": 2.0} and store.rejections("old") == {"digest": 1}
    # Nothing is trimmed from a history that names no round.
    assert saved.upto(0) == saved
