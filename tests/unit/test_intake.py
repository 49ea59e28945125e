"""A job is parsed once, at submit, and stored validated; the queue reads the stored job back
through the same schema (rows written by earlier versions included). The queue's room is a
COUNT; a job needing more sites than are registered is queued with a warning."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest

from fedgpu.core.constants import JobState
from fedgpu.core.job import parse_job
from fedgpu.proto import admin_pb2
from fedgpu.server.jobs.intake import QueueFull
from fedgpu.server.jobs.job_engine import job_from_row
from fedgpu.server.jobs.memory_store import MemoryStore
from fedgpu.server.jobs.queue import JobManager
from fedgpu.server.jobs.state import JobRow
from fedgpu.server.jobs.store import JobStore
from fedgpu.server.registry import Registry


def _manager(tmp_path: Path, sites: int = 0, **kw: Any) -> JobManager:
    registry = Registry()
    for i in range(sites):
        registry.register(name=f"n{i}", peer="p", version="t", devices={}, decision={},
                          labels={}, tasks=["digits"])
    return JobManager(JobStore(tmp_path), registry, tmp_path, chunk_size=1 << 20, **kw)


def _old_row(store: JobStore, job_id: str, text: str, stored: dict) -> JobRow:
    """A row as the intake of earlier versions wrote it: the file's text, and the job as
    that version's parser turned it into a dict."""
    return store.add_job(job_id=job_id, name="old", task="digits", job_toml=text, job=stored,
                         source="submit", source_sha256=hashlib.sha256(text.encode()).hexdigest(),
                         submitted_by="op", rounds=3, state_dir=f"jobs/{job_id}")


def test_the_stored_job_is_the_validated_job(tmp_path: Path) -> None:
    jobs = _manager(tmp_path)
    text = 'task = "digits"\nrounds = 3\nstrategy = "fedadam"\n[strategy_params]\nbeta1 = 0.8\n'
    row = jobs.intake.submit(text, "job.toml", "op")
    assert row.job_toml == text  # kept as submitted, for people
    # What the queue runs is the stored, validated job, read back through the schema.
    assert job_from_row(jobs.get(row.job_id)) == parse_job({
        "task": "digits", "rounds": 3, "strategy": "fedadam",
        "strategy_params": {"beta1": 0.8}})


def test_rows_written_the_old_way_still_load(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    text = 'task = "digits"\nrounds = 3\nmin_nodes = 2\n[hyperparameters]\nlr = 0.1\n'
    job = parse_job({"task": "digits", "rounds": 3, "min_nodes": 2,
                     "hyperparameters": {"lr": 0.1}})
    # The stored dict of an earlier version: fewer keys (each defaults), its own form.
    stored = {"task": "digits", "rounds": 3, "min_nodes": 2, "hyperparameters": {"lr": 0.1},
              "secure_aggregation": None, "privacy": None, "resources": {"gpu": "preferred"}}
    assert job_from_row(_old_row(store, "a1", text, stored)) == job
    # A stored dict this version cannot read (a key since removed): the file as submitted,
    # through the same schema.
    unreadable = {**stored, "hetero": {"local_work": "epochs"}}
    assert job_from_row(_old_row(store, "a2", text, unreadable)) == job
    # Adopted from a state directory from before jobs: no file, only the stored dict.
    adopted = store.add_job(job_id="a3", name="old", task="digits", job_toml="",
                            job=stored, source="migrated", source_sha256="", submitted_by="x",
                            rounds=3, state_dir="jobs/a3")
    assert job_from_row(adopted) == job


class CountOnly(JobStore):
    """The SQLite store, refusing to list the queue: the room check must count."""

    def pending(self) -> list[JobRow]:
        raise AssertionError("the room check loaded every pending row")


def test_the_room_check_counts_without_loading_rows(tmp_path: Path) -> None:
    store = CountOnly(tmp_path)
    jobs = JobManager(store, Registry(), tmp_path, chunk_size=1 << 20, max_queued=3)
    rows = [jobs.intake.submit('task = "digits"\n', f"{i}.toml", "op") for i in range(3)]
    with pytest.raises(QueueFull, match="3 jobs are already queued"):
        jobs.intake.check_room()
    assert store.count_pending() == 3 and store.count_pending(besides=rows[0].job_id) == 2
    store.update(rows[1].job_id, state=JobState.STOPPED)
    jobs.intake.check_room()  # room again
    memory = MemoryStore()
    for i in range(2):
        memory.add_job(job_id=f"m{i}", name="n", task="digits", job_toml="", job={},
                       source="submit", source_sha256="", submitted_by="op", rounds=1,
                       state_dir="x")
    assert memory.count_pending() == 2 and memory.count_pending(besides="m0") == 1


def test_more_min_nodes_than_registered_sites_is_queued_with_a_warning(tmp_path: Path) -> None:
    jobs = _manager(tmp_path, sites=2)
    row = jobs.intake.submit('task = "digits"\nmin_nodes = 5\n', "job.toml", "op")
    assert row.state is JobState.QUEUED
    warning = jobs.intake.shortfall(job_from_row(row))
    assert warning is not None and "min_nodes = 5, but 2 site(s) are registered" in warning
    assert any(e.level == "warning" and "min_nodes = 5" in e.message
               for e in jobs.store.events(row.job_id))
    assert jobs.intake.shortfall(parse_job({"task": "digits", "min_nodes": 2})) is None
    wide = parse_job({"task": "digits", "min_nodes": 1, "min_available_nodes": 4})
    assert "min_available_nodes = 4" in (jobs.intake.shortfall(wide) or "")


# ---- initial weights: every bad file is the same clean refusal; uploads cannot trickle ------
# Threat model: an operator (trusted to run jobs, not to break the aggregator) submitting an
# empty or damaged model, or an upload that trickles or stalls to hold temporary files and
# the aggregator's attention. What they get: a ConfigError naming the problem, and nothing
# left in the state directory; a stalled or trickling upload is cut off, and only
# MAX_IN_FLIGHT submissions are received at once.


def test_an_empty_weights_file_is_a_clean_refusal(tmp_path: Path) -> None:
    from fedgpu.core.errors import ConfigError
    from fedgpu.server.jobs import initial_weights as iw

    serving = tmp_path / "models"
    serving.mkdir()
    (serving / "empty.safetensors").write_bytes(b"")
    jobs = _manager(tmp_path / "state", initial_weights_dir=serving)
    with pytest.raises(ConfigError, match="serves no safetensors file"):
        jobs.intake.submit('task = "digits"\ninitial_weights = "empty.safetensors"\n', "j.toml",
                           "op")
    assert list((tmp_path / "state" / iw.INCOMING).iterdir()) == []
    assert jobs.store.jobs() == []
    empty = tmp_path / "e.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="it is empty"):
        iw.check(empty, "initial_weights (uploaded)")


async def _stream(chunks: list[bytes], pause_s: float = 0.0, hold: Any = None) -> Any:
    for data in chunks:
        if hold is not None:
            await hold.wait()
        await asyncio.sleep(pause_s)
        yield admin_pb2.SubmitJobChunk(data=data)


def _head(weights: bytes) -> Any:
    return admin_pb2.SubmitJobHeader(
        job_toml='task = "digits"\n', filename="j.toml", initial_weights_size=len(weights),
        initial_weights_sha256=hashlib.sha256(weights).hexdigest())


def test_a_stalled_or_trickling_upload_is_cut_off_and_leaves_nothing(tmp_path: Path) -> None:
    from fedgpu.server.jobs import initial_weights as iw
    from fedgpu.server.jobs import submission

    weights = b"x" * 4096
    stalled = submission.receive(_head(weights), _stream([weights[:10], weights[10:]], 0.5),
                                 tmp_path, 1 << 20, idle_s=0.2)
    with pytest.raises(submission.SubmissionError, match="no data for 0.2 s"):
        asyncio.run(stalled)
    trickle = [weights[i:i + 64] for i in range(0, len(weights), 64)]
    slow = submission.receive(_head(weights), _stream(trickle, 0.01), tmp_path, 1 << 20,
                              min_rate_bps=1 << 30, rate_grace_s=0.0)
    with pytest.raises(submission.SubmissionError, match="slower than"):
        asyncio.run(slow)
    assert list((tmp_path / iw.INCOMING).iterdir()) == []


def test_submissions_in_flight_are_capped(tmp_path: Path) -> None:
    from fedgpu.server.jobs.intake import MAX_IN_FLIGHT, TooManySubmissions

    jobs = _manager(tmp_path)
    weights = b"x" * 128

    async def main() -> None:
        hold = asyncio.Event()
        held = [asyncio.create_task(jobs.intake.receive(
            _head(weights), _stream([weights], hold=hold), "op")) for _ in range(MAX_IN_FLIGHT)]
        await asyncio.sleep(0.2)
        with pytest.raises(TooManySubmissions, match=f"{MAX_IN_FLIGHT} job submissions"):
            await jobs.intake.receive(_head(weights), _stream([weights]), "op")
        hold.set()
        # Not safetensors: each is refused, and each frees its place.
        await asyncio.gather(*held, return_exceptions=True)
        assert jobs.intake.in_flight == 0

    asyncio.run(main())
