"""The aggregator's side of tracking: follows every running job (several at once with
--max-concurrent-jobs, each its own MLflow run) from what the job manager holds, and hands
what changed to MLflow off the event loop.

Tracking never stops a job: a store that fails or hangs costs its own calls (each bounded by
a timeout, the error logged once per job), never a round.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from fedgpu.core.constants import ENDED_JOB_STATES
from fedgpu.core.errors import ConfigError
from fedgpu.server.tracking.mlflow_runs import MlflowRuns

if TYPE_CHECKING:
    from fedgpu.server.jobs.queue import ActiveJob, JobManager

log = logging.getLogger("fedgpu.server.tracking")
POLL_S = 1.0
# One call to the store (a remote server's HTTP included): past this it is given up.
CALL_TIMEOUT_S = 60.0
REOPEN_S = 10.0
# What MLflow opens as a tracking store (mlflow.tracking._tracking_service.utils).
STORE_SCHEMES = frozenset({"sqlite", "file", "http", "https", "databricks", "postgresql",
                           "mysql", "mssql"})


class TrackingFollower:
    def __init__(self, jobs: JobManager, uri: str) -> None:
        self.jobs = jobs
        self.uri = uri
        self.runs: MlflowRuns | None = None
        self._run_of: dict[str, str] = {}
        self._seen: dict[str, int] = {}
        self._failed: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        # The running jobs seen at the last poll, by id.
        self._following: dict[str, ActiveJob] = {}
        self._done: set[str] = set()
        self._stop = asyncio.Event()

    async def start(self) -> None:
        """Checks what can be checked at once (MLflow installed, a store scheme it knows);
        the store itself opens in the background: MLflow's import and a new sqlite store's
        migrations take seconds the aggregator's start should not wait for."""
        if importlib.util.find_spec("mlflow") is None:
            raise ConfigError("--tracking-uri needs MLflow on the aggregator: pip install "
                              "'fedgpu[tracking]'")
        scheme = urlparse(self.uri).scheme
        if scheme not in STORE_SCHEMES:
            raise ConfigError(f"--tracking-uri {self.uri}: not an MLflow tracking store (use "
                              "sqlite:///PATH, file:PATH or a tracking server's http(s):// "
                              f"URI; known schemes: {', '.join(sorted(STORE_SCHEMES))})")
        self._task = asyncio.create_task(self._loop(), name="tracking")

    async def _open(self) -> None:
        while self.runs is None:
            try:
                self.runs = await asyncio.wait_for(asyncio.to_thread(MlflowRuns, self.uri),
                                                   CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - MLflow's many kinds of "cannot open"
                log.warning("cannot open the tracking store %s (%s: %s); trying again in "
                            "%.0f s", self.uri, type(exc).__name__, str(exc)[:300],
                            REOPEN_S)
                await asyncio.sleep(REOPEN_S)
        log.info("tracking jobs as MLflow runs at %s", self.uri)

    async def close(self) -> None:
        """A job that ended since the last poll is finished in its run (a short job may have
        ended before the store opened: it is opened now); one still running (the aggregator
        is stopping) keeps its run open for the next start."""
        if self._task is not None:
            self._stop.set()
            if self.runs is None:
                self._task.cancel()  # still opening the store: opened once more below
            # A poll under way ends first: one cancelled while it finished a run left that
            # run RUNNING for good (its job counted as done, its finish call cut off). Its
            # calls are bounded (CALL_TIMEOUT_S each); past twice that it is cut off anyway.
            done, _ = await asyncio.wait({self._task}, timeout=2 * CALL_TIMEOUT_S)
            if not done:
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.runs is None:
            with contextlib.suppress(Exception):
                self.runs = await asyncio.wait_for(asyncio.to_thread(MlflowRuns, self.uri),
                                                   CALL_TIMEOUT_S)
        if self.runs is not None:
            await self._poll()

    async def _loop(self) -> None:
        await self._open()
        while not self._stop.is_set():
            await self._poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), POLL_S)

    async def _poll(self) -> None:
        held = dict(self.jobs.running)
        # The jobs followed until now, and the one the manager ran last (it may have run
        # whole between two polls): each ended one is finished once.
        for ended in (*self._following.values(), self.jobs.last):
            if (ended is not None and ended.row.job_id not in held
                    and ended.row.job_id not in self._done):
                await self._finish(ended)
        self._following = held
        for active in held.values():
            await self._update(active)

    async def _call(self, job_id: str, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the store's trouble, never the job's
            if job_id not in self._failed:
                self._failed.add(job_id)
                log.warning("tracking job %s at %s failed: %s: %s (the job goes on)", job_id,
                            self.uri, type(exc).__name__, exc)
            return None

    async def _update(self, active: ActiveJob) -> None:
        assert self.runs is not None
        job_id = active.row.job_id
        if job_id not in self._run_of:
            run = await self._call(job_id, self.runs.run_for, job_id, active.row.name,
                                   active.row.job)
            if run is None:
                return
            self._run_of[job_id] = run
        history = active.orch.history
        marker = len(history.records) + sum(r.eval is not None for r in history.records)
        if self._seen.get(job_id) == marker:
            return
        self._seen[job_id] = marker
        await self._call(job_id, self.runs.log_rounds, self._run_of[job_id],
                         history.doc(active.orch.run_id))

    async def _finish(self, active: ActiveJob) -> None:
        assert self.runs is not None
        job_id = active.row.job_id
        row = self.jobs.store.get(job_id)
        if row is None or row.state not in ENDED_JOB_STATES:
            # Not ended: the aggregator is stopping, and the job resumes (in this run) at
            # the next start.
            return
        self._done.add(job_id)
        await self._update(active)
        run = self._run_of.pop(job_id, None)
        if run is None:
            return
        state = str(row.state)
        model: Path | None = self.jobs.state_dir / active.row.state_dir / "global.safetensors"
        await self._call(job_id, self.runs.finish, run, state,
                         active.orch.history.doc(active.orch.run_id), model,
                         row.error or row.reason)
