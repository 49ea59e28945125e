"""A job's state is stored once: its round history in the state store, its weights and engine
state in the checkpoint directory; resuming reads both (server/jobs/job_checkpoint.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np

from fedgpu.core.job import parse_job
from fedgpu.server.jobs.job_checkpoint import JobCheckpoint
from fedgpu.server.jobs.memory_store import MemoryStore
from fedgpu.server.jobs.state import HISTORY_KEYS, SavedHistory
from fedgpu.server.jobs.store import JobStore
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.checkpoint import Checkpointer
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.records import EvalEntry, RoundRecord

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "state" / "star-v0.json"
JOB = parse_job({"task": "t", "strategy": "fedavgm", "rounds": 3})


def _record(number: int, status: str = "finished") -> RoundRecord:
    return RoundRecord(number, 1, status, 0.0, 0.0, [], 0, [], None, 0, 0, 0.0)


def _store_with_job(store: MemoryStore | JobStore) -> None:
    store.add_job(job_id="j", name="n", task="t", job_toml="", job=JOB.to_dict(),
                  source="submit", source_sha256="", submitted_by="op", rounds=3,
                  state_dir="jobs/j")


def _weights() -> dict[str, np.ndarray]:
    return {"w": np.arange(4, dtype=np.float32)}


def test_history_goes_to_the_store_and_comes_back_on_resume(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    _store_with_job(store)
    first = Orchestrator(JOB, Registry(), checkpointer=JobCheckpoint(tmp_path / "j", store, "j"))
    first.history.append(_record(1))
    first.history.attach_eval(1, EvalEntry("n1", "site-1", 10, {"accuracy": 0.5, "loss": 1.0}))
    first.history.count_rejection("digest")
    asyncio.run(first.commit(_weights(), 1))

    # state.json holds no history; the store holds it, with the round it goes with.
    on_disk = json.loads((tmp_path / "j" / "state.json").read_text())
    assert not set(HISTORY_KEYS) & set(on_disk) and on_disk["global_round"] == 1
    saved = store.history("j")
    assert saved is not None and saved.global_round == 1
    assert saved.records == first.history.dicts() and saved.rejections == {"digest": 1}
    row = store.get("j")
    assert row is not None and (row.rounds_done, row.accuracy, row.loss) == (1, 0.5, 1.0)

    store.close()
    store = JobStore(tmp_path)
    again = Orchestrator(JOB, Registry(), checkpointer=JobCheckpoint(tmp_path / "j", store, "j"))
    loaded = JobCheckpoint(tmp_path / "j", store, "j").load()
    assert loaded is not None
    again.restore(*loaded)
    assert json.dumps(again.rounds_doc()) == json.dumps(first.rounds_doc())
    assert again.global_round == 1 and again.rejections == {"digest": 1}


def test_a_crash_between_history_and_checkpoint_runs_that_round_again(tmp_path: Path) -> None:
    store = MemoryStore()
    _store_with_job(store)
    ck = JobCheckpoint(tmp_path, store, "j")
    orch = Orchestrator(JOB, Registry(), checkpointer=ck)
    orch.history.append(_record(1))
    asyncio.run(orch.commit(_weights(), 1))
    # Round 2's history was written, then the aggregator died before its checkpoint.
    orch.history.append(_record(2))
    store.save_history("j", SavedHistory.from_state({**orch.checkpoint_state(),
                                                     "global_round": 2}))
    loaded = ck.load()
    assert loaded is not None and loaded[1]["global_round"] == 1
    assert [r["round"] for r in loaded[1]["history"]] == [1]


def test_an_old_state_json_brings_its_history_into_the_store(tmp_path: Path) -> None:
    # A job directory as an aggregator before this one left it: state.json held the history
    # (and the database a copy one commit behind, or none).
    old = json.loads(FIXTURE.read_text())
    Checkpointer(tmp_path).save(_weights(), old)
    store = MemoryStore()
    _store_with_job(store)
    ck = JobCheckpoint(tmp_path, store, "j")
    loaded = ck.load()
    assert loaded is not None
    assert loaded[1]["history"] == old["history"]
    assert loaded[1]["initial_eval"] == old["initial_eval"]
    saved = store.history("j")
    assert saved is not None and saved.records == old["history"]
    assert saved.rejections == old["rejections"]

    orch = Orchestrator(parse_job(old["job"]), Registry(), checkpointer=ck)
    orch.restore(*loaded)
    asyncio.run(orch.commit(orch.global_weights, orch.global_round))  # type: ignore[arg-type]
    on_disk = json.loads((tmp_path / "state.json").read_text())
    assert "history" not in on_disk and on_disk["run_id"] == old["run_id"]
    again = ck.load()
    assert again is not None and again[1]["history"] == old["history"]
