"""Two jobs running at once, as the aggregator's job manager holds them (a real job store,
registry and round engines, not run): each job's round log lines are filed under that job
(`fedgpu job logs JOB`), and the MLflow follower follows both, finishing each run as its job
ends. The tracking store is a recording stand-in (MLflow itself is tests/integration/
test_tracking.py's); the follower and the log handler are the real ones.

Threat model: none beyond correctness: one job's log must not show another job's rounds (a
researcher reads only their own study's jobs), and no running job goes untracked.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

from fedgpu.core.constants import JobState
from fedgpu.server.jobs.events import JobLogHandler
from fedgpu.server.jobs.job_engine import job_from_row
from fedgpu.server.jobs.log_context import job_task
from fedgpu.server.jobs.queue import ActiveJob, JobManager
from fedgpu.server.jobs.store import JobStore
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.tracking.follower import TrackingFollower


def _two_running(tmp_path: Path, task: asyncio.Future[None]) -> tuple[JobManager, list[str]]:
    jobs = JobManager(JobStore(tmp_path), Registry(), tmp_path, chunk_size=1 << 20,
                      max_concurrent=2)
    ids = []
    for name in ("first", "second"):
        row = jobs.intake.submit(f'task = "digits"\nname = "{name}"\n', "job.toml", "test")
        job = job_from_row(row)
        orch = Orchestrator(job, jobs.registry, job_id=row.job_id)
        jobs.running[row.job_id] = ActiveJob(row, job, orch, task)  # type: ignore[arg-type]
        ids.append(row.job_id)
    return jobs, ids


def test_each_jobs_round_lines_go_to_that_job_only(tmp_path: Path) -> None:
    engine_log = logging.getLogger("fedgpu.server.rounds.engine")
    server = logging.getLogger("fedgpu.server")

    async def main() -> dict[str, list[str]]:
        jobs, ids = _two_running(tmp_path, asyncio.get_running_loop().create_future())
        handler = JobLogHandler(jobs)
        server.addHandler(handler)
        level = server.level
        server.setLevel(logging.INFO)
        try:
            async def rounds(n: int) -> None:
                for number in (1, 2):
                    engine_log.info("round %d of engine %d opened", number, n)
                    # A line logged from a thread the engine started is its job's too.
                    await asyncio.to_thread(engine_log.info, "engine %d wrote round %d", n,
                                            number)
                    await asyncio.sleep(0)  # the two engines' lines interleave

            await asyncio.gather(*(job_task(job_id, rounds(n), f"job-{job_id}")
                                   for n, job_id in enumerate(ids)))
            # Outside any job's engine, with two running: the aggregator's log only.
            engine_log.info("a line about no job")
        finally:
            server.removeHandler(handler)
            server.setLevel(level)
        return {job_id: [e.message for e in jobs.store.events(job_id)
                         if e.source == "aggregator" and "engine" in e.message]
                for job_id in ids}

    logged = asyncio.run(main())
    first, second = logged.values()
    assert first == ["round 1 of engine 0 opened", "engine 0 wrote round 1",
                     "round 2 of engine 0 opened", "engine 0 wrote round 2"]
    assert second == ["round 1 of engine 1 opened", "engine 1 wrote round 1",
                      "round 2 of engine 1 opened", "engine 1 wrote round 2"]


class _Runs:
    """The tracking store's calls, recorded (MlflowRuns' methods the follower makes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def run_for(self, job_id: str, name: str, job: Any) -> str:
        self.calls.append(("run_for", job_id))
        return f"run-{job_id}"

    def log_rounds(self, run: str, doc: Any) -> None:
        self.calls.append(("log_rounds", run))

    def finish(self, run: str, state: str, doc: Any, model: Any, reason: Any) -> None:
        self.calls.append((f"finish {state}", run))


def test_the_tracking_follower_follows_every_running_job(tmp_path: Path) -> None:
    async def main() -> tuple[str, str, list[tuple[str, str]], list[tuple[str, str]]]:
        jobs, (a, b) = _two_running(tmp_path, asyncio.get_running_loop().create_future())
        follower = TrackingFollower(jobs, "sqlite:///unused.db")
        runs = follower.runs = _Runs()  # type: ignore[assignment]
        await follower._poll()
        both = list(runs.calls)
        # The second job ends (stopped); the first runs on.
        jobs.last = jobs.running.pop(b)
        jobs.store.update(b, state=JobState.STOPPED, finished_at=time.time())
        await follower._poll()
        await follower._poll()  # an ended job is finished once
        return a, b, both, runs.calls[len(both):]

    a, b, both, after = asyncio.run(main())
    # Each running job has its own run, not only the oldest.
    assert both == [("run_for", a), ("log_rounds", f"run-{a}"),
                    ("run_for", b), ("log_rounds", f"run-{b}")]
    assert [c for c in after if c[0].startswith("finish")] == [("finish stopped", f"run-{b}")]


class _SlowFinish(_Runs):
    """A store whose finish takes a while (logging the model to a remote server)."""

    def __init__(self) -> None:
        super().__init__()
        self.finishing = threading.Event()

    def finish(self, run: str, state: str, doc: Any, model: Any, reason: Any) -> None:
        self.finishing.set()
        time.sleep(0.5)
        super().finish(run, state, doc, model, reason)


def test_a_stop_while_a_run_is_being_finished_lets_that_finish_end(tmp_path: Path) -> None:
    # The aggregator stopped a moment after a job ended, while the follower's own poll was
    # finishing its run: the run must still end FINISHED/STOPPED, once, not stay RUNNING.
    async def main(tmp: Path) -> tuple[str, list[tuple[str, str]]]:
        jobs, (_, b) = _two_running(tmp, asyncio.get_running_loop().create_future())
        follower = TrackingFollower(jobs, "sqlite:///unused.db")
        runs = follower.runs = _SlowFinish()  # type: ignore[assignment]
        await follower.start()
        while ("run_for", b) not in runs.calls:
            await asyncio.sleep(0.01)
        jobs.last = jobs.running.pop(b)
        jobs.store.update(b, state=JobState.STOPPED, finished_at=time.time())
        assert await asyncio.to_thread(runs.finishing.wait, 10)
        await follower.close()
        return b, list(runs.calls)

    b, calls = asyncio.run(main(tmp_path))
    assert [c for c in calls if c[0].startswith("finish")] == [("finish stopped", f"run-{b}")]
