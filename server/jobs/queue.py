"""Jobs on a federation that stays up: a queue, run in submission order, one at a time unless
`--max-concurrent-jobs` allows more (server/jobs/scheduling.py decides which job starts).

The federation (who is connected: the registry) outlives its jobs; each job is an object of
its own with its round engine (an orchestrator), strategy and checkpoints, in
`<state dir>/jobs/<job id>/`. The job list, states, events and round history are in the state
store (fedgpu.server.jobs.state; SQLite on a server), so a restarted aggregator finds its queue
again: queued jobs stay queued, the job that was running resumes from its last finished round
(its weights from the checkpoint, its history from the store), finished jobs stay listed with
their models downloadable.

Several jobs run at once each with its own engine; a node's task pulls and updates go to the
engine whose open round handed that node the task (`engine_for`), never to "the" job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedgpu.core.bundles import BundleRef
from fedgpu.core.constants import JobState, RunState
from fedgpu.core.errors import FedgpuError
from fedgpu.core.job import Job
from fedgpu.proto import pb
from fedgpu.server.jobs import initial_weights as iw
from fedgpu.server.jobs import scheduling, waiting
from fedgpu.server.jobs.bundles import BundleStore, offers_of
from fedgpu.server.jobs.intake import DEFAULT_MAX_QUEUED, Intake
from fedgpu.server.jobs.job_engine import build_engine, job_from_row, starting_weights
from fedgpu.server.jobs.log_context import job_task
from fedgpu.server.jobs.seats import JobRoster, Seats
from fedgpu.server.jobs.state import JobRow, StateStore
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.studies import Studies
from fedgpu.server.transfer.downloads import Downloads
from fedgpu.server.transfer.wire_limits import shown

log = logging.getLogger("fedgpu.server.jobs.queue")

# Ids are 12 hex characters; longer ones are not looked up, and errors echo this many at most.
MAX_JOB_ID = 64
# A failed job's reason, as stored and shown.
MAX_REASON = 2000
# How often a waiting job re-reads who is connected, and a follower polls for events.
_POLL_S = 0.5


class JobError(FedgpuError):
    """A job call that cannot be done: unknown id, already ended."""


@dataclass
class ActiveJob:
    row: JobRow
    job: Job
    orch: Orchestrator
    task: asyncio.Task[None]
    stop_requested: bool = False


class JobManager:
    """The queue: runs one job at a time in submission order, stops jobs, answers what the
    admin documents read. Submissions go through its `intake`."""

    def __init__(self, store: StateStore, registry: Registry, state_dir: Path,
                 chunk_size: int, max_queued: int = DEFAULT_MAX_QUEUED,
                 initial_weights_dir: Path | None = None,
                 max_initial_bytes: int = 4 << 30, studies: Studies | None = None,
                 max_concurrent: int = 1) -> None:
        self.store = store
        # The studies (server/studies.py): a job naming one samples only its enrolled sites.
        self.studies = studies
        iw.clear_incoming(state_dir)
        self.registry = registry
        self.state_dir = state_dir
        self.chunk_size = chunk_size
        # The running jobs, oldest first, and the sites each holds (server/jobs/seats.py).
        self.running: dict[str, ActiveJob] = {}
        self.max_concurrent = max(1, max_concurrent)
        self.seats = Seats()
        # Why a queued job does not start although a place is free (its sites are busy).
        self.blocked: dict[str, str] = {}
        self._starting: set[str] = set()
        # The job that ended last in this process: its engine still answers status queries.
        self.last: ActiveJob | None = None
        self._wake = asyncio.Event()
        # Set when the queue is empty and nothing runs (`--exit-when-done` waits on it).
        self.idle = asyncio.Event()
        # Set when the aggregator is going away: nodes are told to shut down.
        self.exiting = asyncio.Event()
        self._idle_engine: Orchestrator | None = None
        # The upload receiver (server/transfer/uploads.py): its figures are part of the status.
        self.uploads: Any = None
        # Model downloads being sent, counted per chunk (`fedgpu rounds`' progress).
        self.downloads = Downloads()
        self.bundles = BundleStore(state_dir)
        self._offers: list[pb.TaskBundle] | None = None
        self.intake = Intake(store, registry, state_dir, self.bundles,
                             running=self._running_id, queued=self._queued,
                             max_queued=max_queued, initial_weights_dir=initial_weights_dir,
                             max_initial_bytes=max_initial_bytes)

    @property
    def active(self) -> ActiveJob | None:
        """The oldest running job: the one "the running job" means where one is asked for
        (`fedgpu status` without --job, the metrics, the tracking follower)."""
        return next(iter(self.running.values()), None)

    def _running_id(self) -> str | None:
        active = self.active
        return active.row.job_id if active is not None else None

    def _queued(self) -> None:
        """A job was queued: the bundles on offer change, and an idle queue wakes up."""
        self._offers = None
        self._wake.set()

    @property
    def orch(self) -> Orchestrator:
        """The engine updates and task pulls go to: the running job's; between jobs the one
        that ended last (it hands out nothing, and files late answers under its rounds); else
        an idle one that refuses every update as answering no open round."""
        if self.active is not None:
            return self.active.orch
        if self.last is not None:
            return self.last.orch
        if self._idle_engine is None:
            self._idle_engine = Orchestrator(Job(task="(no job)"), self.registry,
                                             chunk_size=self.chunk_size)
        return self._idle_engine

    def task_for(self, node: Node, busy: Collection[str] = (), only: str = "") -> Any:
        """The task a running job's open round has for `node`, oldest job first: one per job
        (a site with --slots may hold several), none the node says it works on (`busy`: its
        other slots'), and only task `only` when given (a secure round's next stage)."""
        engines = [held.orch for held in list(self.running.values())] or [self.orch]
        for orch in engines:
            task = orch.task_for(node)
            if task is not None and task.task_id not in busy and only in ("", task.task_id):
                return task
        return None

    def engine_for(self, node_id: str, task_id: str) -> Orchestrator:
        """The engine an update (or a heartbeat about a task) belongs to: the running job
        whose open round handed this node this task; else the oldest (which refuses it as
        answering none of its rounds, as a late answer always was)."""
        for held in list(self.running.values()):
            rnd = held.orch.current
            if rnd is not None and rnd.task_ids.get(node_id) == task_id:
                return held.orch
        return self.orch

    def wants(self, node: Node, task_id: str) -> bool:
        return self.engine_for(node.node_id, task_id).answers.wants(node, task_id)

    # ---- stopping --------------------------------------------------------------------

    def stop(self, job_id: str) -> JobRow:
        row = self.get(job_id)
        if row.ended:
            return row
        active = self.running.get(job_id)
        if active is not None:
            active.stop_requested = True
            active.task.cancel()
        else:
            self.store.update(job_id, state=JobState.STOPPED, finished_at=time.time(),
                              reason=None)
        self._offers = None
        self.store.add_event(job_id, "stop requested by an operator", level="warning")
        log.info("job %s: stop requested", job_id)
        return self.get(job_id)

    def get(self, job_id: str) -> JobRow:
        # Echoed bounded: an id of megabytes must not come back whole in the error.
        row = self.store.get(job_id) if len(job_id) <= MAX_JOB_ID else None
        if row is None:
            raise JobError(f"no job {shown(job_id, MAX_JOB_ID)} on this aggregator; 'fedgpu "
                           "job list' shows the jobs")
        return row

    # ---- running -----------------------------------------------------------------------

    async def run_forever(self) -> None:
        """Run queued jobs until cancelled: one after the other, or up to max_concurrent at
        once. Cancelled (the aggregator stops), the running jobs stay running in the store
        and resume at the next start."""
        runners: set[asyncio.Task[None]] = set()
        try:
            while True:
                self._wake.clear()
                row = self._next()
                if row is not None:
                    self.idle.clear()
                    # Counted from now (the runner reads weights before its engine exists).
                    self._starting.add(row.job_id)
                    runner = asyncio.create_task(self._run(row), name=f"run-{row.job_id}")
                    runners.add(runner)
                    runner.add_done_callback(self._ended)
                    continue
                if not runners:
                    self.idle.set()
                # Several at once: the queue looks again as sites come, go and are taken by
                # the running jobs' rounds, not only when jobs start and end.
                again = _POLL_S * 2 if self.max_concurrent > 1 and runners else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=again)
                runners = {r for r in runners if not r.done()}
        finally:
            for runner in runners:
                runner.cancel()
            await asyncio.gather(*runners, return_exceptions=True)

    def _ended(self, runner: asyncio.Task[None]) -> None:
        if not runner.cancelled() and runner.exception() is not None:
            log.error("a job's runner failed", exc_info=runner.exception())

    def _next(self) -> JobRow | None:
        busy = self.running.keys() | self._starting
        full = len(busy) >= self.max_concurrent
        if full and self.max_concurrent == 1:
            return None  # one at a time: the next job is simply "after" the running one
        pending = [r for r in self.store.pending() if r.job_id not in busy]
        if not busy:
            self.blocked = {}
            return pending[0] if pending else None
        # Full, it is still asked: a queued job says which job holds the sites it needs.
        row, self.blocked = scheduling.next_job(pending, self, job_from_row)
        return None if full else row

    async def _run(self, row: JobRow) -> None:
        try:
            await self._run_job(row)
        finally:
            self._starting.discard(row.job_id)
            self.running.pop(row.job_id, None)
            self._wake.set()

    async def _run_job(self, row: JobRow) -> None:
        try:
            job = job_from_row(row)
            # Reading (and checking) the weights may take seconds for a large model.
            initial = await asyncio.to_thread(starting_weights, self.store, self.state_dir,
                                              row, job)
            orch = build_engine(row, job, initial, store=self.store, registry=self.registry,
                                state_dir=self.state_dir, chunk_size=self.chunk_size,
                                roster=self.roster(row.job_id))
        except Exception as exc:  # noqa: BLE001 - whatever it is ends this job, not the queue
            if not self._stopped_meanwhile(row.job_id):
                self._fail(row.job_id, exc)
            return
        if self._stopped_meanwhile(row.job_id):
            return
        # From here to `self.running` nothing awaits: a stop now finds the job running, and
        # cancels its engine (the row and the engine never disagree).
        # Its engine's log lines name it (`job logs`, several jobs at once).
        task = job_task(row.job_id, orch.run(), name=f"job-{row.job_id}")
        active = self.running[row.job_id] = ActiveJob(row, job, orch, task)
        self._starting.discard(row.job_id)
        if not row.started_at:
            self.store.update(row.job_id, started_at=time.time())
        self.store.update(row.job_id, state=JobState.RUNNING, run_id=orch.run_id)
        self.store.add_event(row.job_id, f"started (run {orch.run_id})")
        crash: Exception | None = None
        try:
            await task
        except asyncio.CancelledError:
            if not active.stop_requested or not task.done():
                # The aggregator itself is stopping: the job stays running in the
                # database and resumes at the next start.
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self.running.pop(row.job_id, None)
                self.seats.release(row.job_id)
                raise
        except Exception as exc:  # noqa: BLE001 - a bug in a job ends the job, not the queue
            crash = exc
        self.running.pop(row.job_id, None)
        self.last = active
        self.seats.release(row.job_id)
        for node in self.registry.all():
            # Nodes drop whatever the ended job had handed them (a stopped job's open round);
            # the other jobs' tasks stay theirs.
            node.assigned.pop(row.job_id, None)
        state = {RunState.FINISHED: JobState.FINISHED, RunState.FAILED: JobState.FAILED}.get(
            orch.state, JobState.STOPPED)
        if active.stop_requested:
            state = JobState.STOPPED
        if crash is not None and not active.stop_requested:
            self._fail(row.job_id, crash)
            return
        self._end(row.job_id, state, orch.error, orch.end_reason)

    def _stopped_meanwhile(self, job_id: str) -> bool:
        """A `job stop` that came while the job was being set up (its weights read in a
        thread) ended the row: the job does not start, and the queue moves on."""
        fresh = self.store.get(job_id)
        if fresh is None or not fresh.ended:
            return False
        log.info("job %s was %s while it was being started; not started", job_id, fresh.state)
        self._offers = None
        return True

    def _fail(self, job_id: str, exc: Exception) -> None:
        if isinstance(exc, FedgpuError):
            self._end(job_id, JobState.FAILED, str(exc)[:MAX_REASON])
            return
        # Not a refusal we wrote: the traceback goes to the aggregator's log only.
        log.error("job %s failed on an unexpected error", job_id, exc_info=exc)
        self._end(job_id, JobState.FAILED, f"internal error ({type(exc).__name__}: "
                  f"{str(exc)[:MAX_REASON]}); the aggregator's log has the details")

    def _end(self, job_id: str, state: JobState, error: str | None,
             reason: str | None = None) -> None:
        self.store.update(job_id, state=state, error=error, reason=reason,
                          finished_at=time.time())
        self._offers = None
        self.store.add_event(job_id, f"{state}" + (f": {error or reason}" if error or reason
                                                   else ""),
                             level="error" if state is JobState.FAILED else "info")
        log.info("job %s %s%s", job_id, state, f": {error}" if error else "")

    def roster(self, job_id: str) -> JobRoster:
        """Who job `job_id` may sample: its study's sites, not held by another running job."""
        return JobRoster(job_id, self.seats, self.studies)

    # ---- what the admin documents read (server/jobs/waiting.py) -----------------------

    def live_state(self, row: JobRow) -> tuple[JobState, str | None]:
        """The job's state now, with the reason it waits (computed, not stored)."""
        return waiting.live_state(self, row)

    def node_parts(self, job: Job, bundle: BundleRef | None, job_id: str = ""
                   ) -> list[dict[str, Any]]:
        return waiting.node_parts(self, job, bundle, job_id)

    # ---- bundles -------------------------------------------------------------------------

    def offers(self) -> list[pb.TaskBundle]:
        """The bundles of the jobs not yet ended (oldest first): nodes fetch them ahead of the
        job's turn, so their sites can approve them, and answer about each in heartbeats."""
        if self._offers is None:
            self._offers = offers_of(self.store.pending())
        return self._offers

    def bundle_for_node(self, sha256: str) -> tuple[pb.TaskBundle, bytes]:
        """An offered bundle's header and bytes; JobError for any other hash."""
        offer = next((o for o in self.offers() if o.sha256 == sha256), None)
        if offer is None:
            raise JobError(f"no job waiting or running here has bundle {sha256[:64]!r}")
        return offer, self.bundles.read(sha256)

    def model_file(self, job_id: str) -> Path:
        row = self.get(job_id)
        path = self.state_dir / row.state_dir / "global.safetensors"
        if not path.exists():
            raise JobError(f"job {job_id} has no model yet ({row.state}): the first "
                           "checkpoint is written once a node built the initial model")
        return path

