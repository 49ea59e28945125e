"""What every state store does (server/jobs/state.py): the SQLite one the aggregator runs on
and the memory one, through the same calls, with the same answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedgpu.core.constants import JobState
from fedgpu.server.jobs.memory_store import MemoryStore
from fedgpu.server.jobs.state import SavedHistory, StateStore
from fedgpu.server.jobs.store import JobStore


@pytest.fixture(params=["sqlite", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    if request.param == "sqlite":
        s = JobStore(tmp_path, max_events_per_job=5)
        yield s
        s.close()
    else:
        yield MemoryStore(max_events_per_job=5)


def _add(store: StateStore, job_id: str, sha: str = "abc") -> None:
    store.add_job(job_id=job_id, name=f"n-{job_id}", task="digits", job_toml="x",
                  job={"task": "digits"}, source="submit", source_sha256=sha,
                  submitted_by="operator", rounds=3, state_dir=f"jobs/{job_id}")


def test_queue_order_states_and_lookups(store: StateStore) -> None:
    for jid in ("b", "a", "c"):
        _add(store, jid, sha=jid)
    store.update("b", state=JobState.RUNNING, started_at=1.0)
    store.update("a", state="finished", rounds_done=3, accuracy=0.9)
    assert [j.job_id for j in store.jobs()] == ["b", "a", "c"]
    assert [j.job_id for j in store.jobs(limit=2)] == ["a", "c"]
    assert [j.job_id for j in store.pending()] == ["b", "c"]
    a = store.get("a")
    assert a is not None and a.state is JobState.FINISHED and a.ended and a.accuracy == 0.9
    assert store.get("zzz") is None
    found = store.find_source("submit", "c")
    assert found is not None and found.job_id == "c"
    assert store.find_source("server-start", "c") is None
    with pytest.raises(ValueError, match="job_toml"):
        store.update("a", job_toml="evil")
    with pytest.raises(ValueError):
        store.update("a", state="exploded")


def test_events_are_numbered_cut_and_bounded(store: StateStore) -> None:
    _add(store, "a")
    for i in range(8):
        store.add_event("a", f"event {i}")
    assert [e.seq for e in store.events("a")] == [4, 5, 6, 7, 8]
    assert [e.seq for e in store.events("a", after=6)] == [7, 8]
    assert [e.seq for e in store.events("a", limit=2)] == [4, 5]
    seq = store.add_event("a", "x" * 10_000, level="error", source="node", node="site-a")
    last = store.events("a", after=seq - 1)[0]
    assert len(last.message) < 5_000 and "more characters cut" in last.message


def test_history_is_replaced_whole_and_read_back(store: StateStore) -> None:
    _add(store, "a")
    assert store.history("a") is None and store.rejections("a") == {}
    store.save_history("a", SavedHistory([{"round": 1, "status": "finished", "eval": None}]))
    records = [{"round": 1, "status": "finished", "eval": {"accuracy": 0.5}},
               {"round": 2, "status": "retried", "eval": None}]
    store.save_history("a", SavedHistory(records, {"accuracy": 0.1}, {"digest": 2}, 2))
    # What the caller goes on changing after saving (late evaluations) is not what was saved.
    records[0]["eval"] = None
    saved = store.history("a")
    assert saved is not None
    assert [h["round"] for h in saved.records] == [1, 2]
    assert saved.records[0]["eval"] == {"accuracy": 0.5}
    assert (saved.initial_eval, saved.rejections, saved.global_round) == (
        {"accuracy": 0.1}, {"digest": 2}, 2)
    assert store.rejections("a") == {"digest": 2}


def test_a_history_ahead_of_its_checkpoint_loses_the_uncommitted_round() -> None:
    records = [{"round": 1, "status": "finished"}, {"round": 2, "status": "retried"},
               {"round": 2, "status": "finished"}]
    ahead = SavedHistory(records, None, {"digest": 1}, 2)
    assert ahead.upto(2) is ahead
    back = ahead.upto(1)
    assert back.records == records[:1] and back.global_round == 1
    assert back.rejections == {"digest": 1}
