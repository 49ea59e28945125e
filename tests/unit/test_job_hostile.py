"""An operator's job files against the aggregator (issue 24): an operator is trusted to run
jobs, not to crash, freeze or exhaust the aggregator. Each case here broke it before: a number
past the wire's int64, a min_nodes that cost its square in memory, a job whose setup raised
outside the handled errors (the queue stopped for good), initial weights read from any path on
the host (a FIFO froze the event loop, /etc/passwd leaked into the error), a checkpoint served
a round older than the one announced."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.core.constants import JobState
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Job, loads_toml, parse_job
from fedgpu.core.job_bounds import INT64_MAX, INT64_MIN, MAX_RING_NODES, derived_seed
from fedgpu.proto import pb
from fedgpu.server.jobs import initial_weights as iw
from fedgpu.server.jobs.intake import QueueFull
from fedgpu.server.jobs.job_engine import starting_weights
from fedgpu.server.jobs.queue import JobError, JobManager
from fedgpu.server.jobs.store import JobStore
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.checkpoint import Checkpointer
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.plans import StarPlan

WEIGHTS = {"w": np.ones((2, 2), np.float32)}


def manager(tmp_path: Path, **kw: Any) -> JobManager:
    return JobManager(JobStore(tmp_path), Registry(), tmp_path, chunk_size=1 << 20, **kw)


# ---- numbers: bounded to what the wire and SQLite hold ------------------------------------


@pytest.mark.parametrize(("raw", "message"), [
    ({"seed": 1 << 63}, r"'seed' must be from -9,223,372,036,854,775,808 to "
                        r"9,223,372,036,854,775,807"),
    ({"seed": -(1 << 63) - 1}, "'seed' must be from"),
    ({"rounds": 10**20}, "'rounds' must be from 1 to 2,147,483,647"),
    ({"min_nodes": 10**9}, "'min_nodes' must be from 1 to 1,000,000"),
    ({"min_nodes": 2, "min_available_nodes": 10**7}, "'min_available_nodes' must be from"),
    ({"round_retries": 10**6}, "'round_retries' must be from 0 to 1,000"),
    ({"max_examples_per_node": 1 << 64}, "'max_examples_per_node' must be from"),
    ({"round_deadline_s": 1e300}, "'round_deadline_s' must be from"),
    ({"mode": "ring", "ring_timeout_s": 1e12}, "'ring_timeout_s' must be from"),
    ({"mode": "ring", "local_steps": 1 << 40}, "'local_steps' must be from"),
    ({"hyperparameters": {"lr": 10**30}}, "'hyperparameters.lr' must be from"),
    ({"strategy_params": {"beta": -(10**30)}}, "'strategy_params.beta' must be from"),
    ({"mode": "ring", "min_nodes": MAX_RING_NODES + 1}, "ring job must be from 1 to 1024"),
])
def test_numbers_past_the_wire_are_refused_with_their_range(raw: dict[str, Any],
                                                           message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        parse_job({"task": "digits", **raw}, "job.toml")
    assert len(str(refused.value)) < 300  # a 10**30 is not echoed digit by digit


def test_a_huge_number_is_echoed_short() -> None:
    with pytest.raises(ConfigError, match=r"about 5001 digits") as refused:
        parse_job({"task": "digits", "rounds": 10**5000}, "job.toml")
    assert len(str(refused.value)) < 200


def test_every_seed_in_range_gives_task_seeds_the_wire_carries() -> None:
    # seed = 10**13 overflowed TaskHeader.seed once multiplied: the job stayed running forever.
    for seed in (0, 7, 10**13, INT64_MAX, INT64_MIN, -1):
        job = parse_job({"task": "digits", "seed": seed})
        plan = StarPlan(job)
        for number, attempt in ((1, 1), (2**31 - 1, 1001)):
            (fields,) = plan.task_fields(number, attempt, [object()])  # type: ignore[list-item]
            assert INT64_MIN <= fields["seed"] <= INT64_MAX
            pb.TaskHeader(seed=fields["seed"])  # raises ValueError when out of range
    # Seeds that fit keep the value they always had.
    assert derived_seed(7, 3, 2) == 7 * 1_000_003 + 3 * 1009 + 2


def test_a_star_job_never_builds_a_mixing_matrix() -> None:
    # 30,000 nodes took 28 s and 6.9 GB when every parse built a min_nodes^2 matrix.
    started = time.perf_counter()
    job = parse_job({"task": "digits", "min_nodes": 1_000_000})
    assert time.perf_counter() - started < 1.0
    assert job.mixing == "uniform"
    with pytest.raises(ConfigError, match="'mixing' must be \"uniform\""):
        parse_job({"task": "digits", "mixing": "ring-of-fire"})
    # A ring job still gets (and checks) its matrix.
    ring = parse_job({"task": "digits", "mode": "ring", "min_nodes": 4, "iterations": 10})
    assert ring.mixing == "uniform"


def test_a_job_file_nested_too_deep_is_a_refusal() -> None:
    deep = "x = " + "[" * 20_000 + "]" * 20_000 + "\n"
    with pytest.raises(ConfigError, match="nested too deep"):
        loads_toml(deep, "job.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        loads_toml("task = ", "job.toml")
    with pytest.raises(ConfigError, match="not valid TOML: Exceeds the limit"):
        loads_toml("seed = " + "9" * 5000, "job.toml")


# ---- the queue: one job's failure ends that job, never the queue ---------------------------


async def _run_queue_until(jobs: JobManager, done: Any, timeout: float = 20) -> None:
    runner = asyncio.create_task(jobs.run_forever())
    try:
        end = time.monotonic() + timeout
        while not done():
            assert not runner.done(), runner.exception()
            assert time.monotonic() < end, "the queue never got there"
            await asyncio.sleep(0.05)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


def _weights_file(tmp_path: Path) -> Path:
    path = tmp_path / "w.safetensors"
    path.write_bytes(codec.encode(WEIGHTS).to_bytes())
    return path


def test_a_job_whose_setup_raises_anything_fails_alone(tmp_path: Path) -> None:
    """The weights of the first job became a directory (an IsADirectoryError, not one of the
    handled errors): before, run_forever died and every later job stayed queued."""
    jobs = manager(tmp_path / "state")
    weights = iw.incoming_path(jobs.state_dir)
    weights.write_bytes(_weights_file(tmp_path).read_bytes())
    bad = jobs.intake.submit('task = "digits"\ninitial_weights = "w.safetensors"\n', "a.toml",
                             "op", weights=weights)
    stored = jobs.state_dir / bad.state_dir / iw.STORED
    assert stored.is_file()
    stored.unlink()
    stored.mkdir()
    good = jobs.intake.submit('task = "digits"\n', "b.toml", "op")

    def second_started() -> bool:
        return jobs.store.get(good.job_id).state is not JobState.QUEUED  # type: ignore[union-attr]

    asyncio.run(_run_queue_until(jobs, second_started))
    failed = jobs.get(bad.job_id)
    assert failed.state is JobState.FAILED
    assert failed.error and "IsADirectoryError" in failed.error


def test_a_job_whose_run_raises_anything_fails_alone(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = manager(tmp_path)
    calls = []

    async def broken(self: Orchestrator) -> None:
        calls.append(self)
        if len(calls) == 1:
            raise PermissionError(13, "Permission denied")
        await asyncio.sleep(3600)

    monkeypatch.setattr(Orchestrator, "run", broken)
    first = jobs.intake.submit('task = "digits"\n', "a.toml", "op")
    second = jobs.intake.submit('task = "digits"\n', "b.toml", "op")
    asyncio.run(_run_queue_until(jobs, lambda: len(calls) == 2))
    row = jobs.get(first.job_id)
    assert row.state is JobState.FAILED and "PermissionError" in (row.error or "")
    assert jobs.get(second.job_id).state is JobState.RUNNING


def test_the_queue_has_a_limit(tmp_path: Path) -> None:
    jobs = manager(tmp_path, max_queued=3)
    for i in range(3):
        jobs.intake.submit('task = "digits"\n', f"{i}.toml", "op")
    with pytest.raises(QueueFull, match="3 jobs are already queued.*--max-queued-jobs 3"):
        jobs.intake.submit('task = "digits"\n', "more.toml", "op")
    assert len(jobs.store.pending()) == 3
    jobs.stop(jobs.store.pending()[0].job_id)
    jobs.intake.submit('task = "digits"\n', "after-a-stop.toml", "op")


def test_an_unknown_job_id_is_echoed_bounded(tmp_path: Path) -> None:
    jobs = manager(tmp_path)
    for job_id in ("x" * 100_000, "y" * (4 << 20)):
        with pytest.raises(JobError) as err:
            jobs.get(job_id)
        assert len(str(err.value)) < 300
        with pytest.raises(JobError):
            jobs.stop(job_id)


# ---- initial weights: uploaded, or from the directory the aggregator serves -----------------


def test_initial_weights_come_only_from_the_serving_directory(tmp_path: Path) -> None:
    serving = tmp_path / "models"
    serving.mkdir()
    (serving / "base.safetensors").write_bytes(codec.encode(WEIGHTS).to_bytes())
    (serving / "sub").mkdir()
    (serving / "escape.safetensors").symlink_to("/etc/passwd")
    os.mkfifo(serving / "fifo.safetensors")
    (serving / "text.safetensors").write_text("root:x:0:0:root:/root:/bin/bash\n")
    jobs = manager(tmp_path / "state", initial_weights_dir=serving, max_initial_bytes=1 << 20)
    row = jobs.intake.submit('task = "digits"\ninitial_weights = "base.safetensors"\n', "j.toml",
                             "op")
    stored = iw.load(jobs.state_dir / row.state_dir)
    assert stored is not None and np.array_equal(stored["w"], WEIGHTS["w"])

    messages = set()
    for name in ("/etc/passwd", "../../etc/passwd", "missing.safetensors", "sub",
                 "escape.safetensors", "fifo.safetensors", "text.safetensors"):
        started = time.perf_counter()
        with pytest.raises(ConfigError) as refused:
            jobs.intake.submit(f'task = "digits"\ninitial_weights = "{name}"\n', "j.toml", "op")
        assert time.perf_counter() - started < 2  # a FIFO never blocks the read
        text = str(refused.value).replace(repr(name), "NAME")
        assert "root:" not in text and "bash" not in text  # no content oracle
        messages.add(text)
    assert len(messages) == 1, messages  # no existence oracle: one refusal for every case
    assert len(jobs.store.pending()) == 1
    assert not list((jobs.state_dir / iw.INCOMING).iterdir())  # nothing left behind


def test_without_a_serving_directory_a_named_path_is_refused(tmp_path: Path) -> None:
    jobs = manager(tmp_path)
    with pytest.raises(ConfigError, match="reads no files named by a job.*fedgpu job submit"):
        jobs.intake.submit('task = "digits"\ninitial_weights = "/etc/hostname"\n', "j.toml", "op")


def test_server_start_reads_a_regular_file_only(tmp_path: Path) -> None:
    jobs = manager(tmp_path / "state", max_initial_bytes=1 << 20)
    os.mkfifo(tmp_path / "fifo")
    job = tmp_path / "job.toml"
    job.write_text('task = "digits"\ninitial_weights = "fifo"\n')
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="not a regular file"):
        jobs.intake.submit_at_start(job)
    assert time.perf_counter() - started < 2
    big = tmp_path / "big.safetensors"
    big.write_bytes(b"\0" * ((1 << 20) + 1))
    job.write_text('task = "digits"\ninitial_weights = "big.safetensors"\n')
    with pytest.raises(ConfigError, match="over the aggregator's limit"):
        jobs.intake.submit_at_start(job)
    _weights_file(tmp_path)
    job.write_text('task = "digits"\ninitial_weights = "w.safetensors"\n')
    row = jobs.intake.submit_at_start(job)
    assert (jobs.state_dir / row.state_dir / iw.STORED).is_file()


# ---- the checkpoint is committed before the round count moves -------------------------------


class SlowCheckpointer(Checkpointer):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.writing = threading.Event()
        self.release = threading.Event()

    def save(self, *args: Any, **kwargs: Any) -> Any:
        self.writing.set()
        assert self.release.wait(10)
        return super().save(*args, **kwargs)


def test_rounds_done_moves_only_after_the_checkpoint_file(tmp_path: Path) -> None:
    checkpointer = SlowCheckpointer(tmp_path)
    orch = Orchestrator(Job(task="digits"), Registry(), checkpointer=checkpointer,
                        initial_weights=WEIGHTS)

    async def scenario() -> list[int]:
        seen = []
        commit = asyncio.create_task(orch.commit({"w": WEIGHTS["w"] + 1}, 1))
        while not checkpointer.writing.is_set():
            await asyncio.sleep(0.01)
        seen.append(orch.global_round)  # the file of round 1 is being written
        checkpointer.release.set()
        await commit
        seen.append(orch.global_round)
        return seen

    assert asyncio.run(scenario()) == [0, 1]
    assert (tmp_path / "global.safetensors").exists()


def test_a_job_queued_with_a_path_by_an_earlier_version(tmp_path: Path) -> None:
    """Earlier versions kept the path and read it at start: such a job fails with a reason
    when it has not started, and resumes from its checkpoint when it has."""
    jobs = manager(tmp_path)
    text = 'task = "digits"\ninitial_weights = "/srv/models/w.safetensors"\n'
    job = parse_job(loads_toml(text))
    row = jobs.store.add_job(job_id="0123456789ab", name="old", task="digits", job_toml=text,
                             job=job.to_dict(), source="submit", source_sha256="",
                             submitted_by="op", rounds=job.rounds,
                             state_dir="jobs/0123456789ab")
    with pytest.raises(ConfigError, match="not stored with this job.*submit it again"):
        starting_weights(jobs.store, jobs.state_dir, row, job)
    (tmp_path / row.state_dir).mkdir(parents=True)
    (tmp_path / row.state_dir / "state.json").write_text("{}")
    assert starting_weights(jobs.store, jobs.state_dir, row, job) is None
