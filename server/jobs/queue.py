"""Jobs on a federation that stays up: a queue, run one at a time in submission order.

The federation (who is connected: the registry) outlives its jobs; each job is an object of
its own with its round engine (an orchestrator), strategy and checkpoints, in
`<state dir>/jobs/<job id>/`. The job list, states, events and round history are in the state
store (fedgpu.server.jobs.state; SQLite on a server), so a restarted aggregator finds its queue
again: queued jobs stay queued, the job that was running resumes from its last finished round
(its weights from the checkpoint, its history from the store), finished jobs stay listed with
their models downloadable.

Running several jobs at once would be a change of policy here (`_next`), not of the jobs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core.bundles import BundleRef
from fedgpu.core.constants import JobState, Mode, RunState
from fedgpu.core.errors import ConfigError, FedgpuError
from fedgpu.core.job import Job, loads_toml, parse_job, with_bundle_task
from fedgpu.proto import pb
from fedgpu.server.jobs import initial_weights as iw
from fedgpu.server.jobs import resume
from fedgpu.server.jobs.bundles import BundleStore, offers_of
from fedgpu.server.jobs.intake import DEFAULT_MAX_QUEUED, Intake
from fedgpu.server.jobs.job_checkpoint import JobCheckpoint
from fedgpu.server.jobs.state import JobRow, StateStore
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.buffered import AsyncPlan
from fedgpu.server.rounds.eligibility import eligibility
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.ring import RingPlan
from fedgpu.server.secagg.plan import SecAggPlan
from fedgpu.server.studies import Studies
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


def job_from_row(row: JobRow) -> Job:
    """The job a row stores, read back through the job schema: the validated job the intake
    stored (job_json, Job.to_dict). A row whose stored job this version cannot read (written
    by a version whose to_dict differed) falls back to the file as submitted, parsed by the
    same schema."""
    where = f"job {row.job_id}"
    try:
        job = Job.from_dict(dict(row.job), where)
    except ConfigError:
        if not row.job_toml:
            raise
        log.info("%s: its stored job does not read back; parsing its job file", where)
        job = parse_job(loads_toml(row.job_toml, where), where)
    return with_bundle_task(job, row.bundle_name or row.task) if row.bundle_sha256 else job


class JobManager:
    """The queue: runs one job at a time in submission order, stops jobs, answers what the
    admin documents read. Submissions go through its `intake`."""

    def __init__(self, store: StateStore, registry: Registry, state_dir: Path,
                 chunk_size: int, max_queued: int = DEFAULT_MAX_QUEUED,
                 initial_weights_dir: Path | None = None,
                 max_initial_bytes: int = 4 << 30, studies: Studies | None = None) -> None:
        self.store = store
        # The studies (server/studies.py): a job naming one samples only its enrolled sites.
        self.studies = studies
        iw.clear_incoming(state_dir)
        self.registry = registry
        self.state_dir = state_dir
        self.chunk_size = chunk_size
        self.active: ActiveJob | None = None
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
        self.bundles = BundleStore(state_dir)
        self._offers: list[pb.TaskBundle] | None = None
        self.intake = Intake(store, registry, state_dir, self.bundles,
                             running=self._running_id, queued=self._queued,
                             max_queued=max_queued, initial_weights_dir=initial_weights_dir,
                             max_initial_bytes=max_initial_bytes)

    def _running_id(self) -> str | None:
        return self.active.row.job_id if self.active is not None else None

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

    # ---- stopping --------------------------------------------------------------------

    def stop(self, job_id: str) -> JobRow:
        row = self.get(job_id)
        if row.ended:
            return row
        active = self.active
        if active is not None and active.row.job_id == job_id:
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
        """Run queued jobs one after the other until cancelled."""
        while True:
            row = self._next()
            if row is None:
                self.idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self.idle.clear()
            await self._run(row)

    def _next(self) -> JobRow | None:
        pending = self.store.pending()
        return pending[0] if pending else None

    async def _run(self, row: JobRow) -> None:
        try:
            job = job_from_row(row)
            # Reading (and checking) the weights may take seconds for a large model.
            initial = await asyncio.to_thread(self._initial_weights, row, job)
            orch = self._orchestrator(row, job, initial)
        except Exception as exc:  # noqa: BLE001 - whatever it is ends this job, not the queue
            if not self._stopped_meanwhile(row.job_id):
                self._fail(row.job_id, exc)
            return
        if self._stopped_meanwhile(row.job_id):
            return
        # From here to `self.active` nothing awaits: a stop now finds the job active, and
        # cancels its engine (the row and the engine never disagree).
        task = asyncio.create_task(orch.run(), name=f"job-{row.job_id}")
        self.active = ActiveJob(row, job, orch, task)
        if not row.started_at:
            self.store.update(row.job_id, started_at=time.time())
        self.store.update(row.job_id, state=JobState.RUNNING, run_id=orch.run_id)
        self.store.add_event(row.job_id, f"started (run {orch.run_id})")
        crash: Exception | None = None
        try:
            await task
        except asyncio.CancelledError:
            if not self.active.stop_requested or not task.done():
                # The aggregator itself is stopping: the job stays running in the
                # database and resumes at the next start.
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self.active = None
                raise
        except Exception as exc:  # noqa: BLE001 - a bug in a job ends the job, not the queue
            crash = exc
        active, self.active = self.active, None
        self.last = active
        for node in self.registry.all():
            # Nodes drop whatever the ended job had handed them (a stopped job's open round).
            node.pending = None
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

    def _initial_weights(self, row: JobRow, job: Job) -> dict[str, np.ndarray] | None:
        directory = self.state_dir / row.state_dir
        initial = iw.load(directory)
        if initial is None and job.initial_weights is not None:
            if (directory / "state.json").exists():
                # Started by an earlier version, which kept a path: the checkpoint holds the
                # model now, and the path is not read (only a resume check would use it).
                log.info("job %s: initial_weights were a path on this host; resuming from "
                         "its checkpoint without them", row.job_id)
                return None
            raise ConfigError("initial_weights were not stored with this job (it was queued "
                              "by an earlier version, which kept a path): submit it again")
        return initial

    def _orchestrator(self, row: JobRow, job: Job,
                      initial: dict[str, np.ndarray] | None) -> Any:
        directory = self.state_dir / row.state_dir
        checkpointer = JobCheckpoint(directory, self.store, row.job_id)
        saved = checkpointer.load()
        if saved is not None:
            resume.check(job, saved[0], saved[1], initial, directory)
        orch = Orchestrator(job, self.registry, chunk_size=self.chunk_size,
                            checkpointer=checkpointer, initial_weights=initial,
                            plan=(RingPlan(job) if job.mode == Mode.RING
                                  else SecAggPlan(job) if job.secure_aggregation
                                  else AsyncPlan(job) if job.mode == Mode.ASYNC else None),
                            bundle=row.bundle, job_id=row.job_id, roster=self.studies)
        if saved is not None:
            orch.restore(*saved)
            self.store.add_event(row.job_id, f"resumed after round {orch.global_round}")
        return orch

    # ---- what the admin documents read ---------------------------------------------

    def live_state(self, row: JobRow) -> tuple[JobState, str | None]:
        """The job's state now, with the reason it waits (computed, not stored)."""
        active = self.active
        if active is None or active.row.job_id != row.job_id:
            if row.state in (JobState.RUNNING, JobState.WAITING):
                # Its turn comes as soon as the aggregator's loop picks it up.
                return JobState.QUEUED, "resuming"
            if row.state is JobState.QUEUED and active is not None:
                return JobState.QUEUED, f"after job {active.row.job_id}"
            return row.state, row.reason
        if active.orch.state == RunState.WAITING or active.orch.waiting_for_nodes:
            return JobState.WAITING, self.waiting_reason(active.job, active.row.bundle)
        return JobState.RUNNING, None

    def waiting_reason(self, job: Job, bundle: BundleRef | None) -> str:
        nodes = self.registry.all()
        able = [n for n in nodes
                if eligibility(job, n, self.registry.is_alive(n), bundle, self.studies) is None]
        need = job.min_available_nodes or job.min_nodes
        if len(able) >= need:
            return "starting"
        why = {}
        for n in nodes:
            reason = eligibility(job, n, self.registry.is_alive(n), bundle, self.studies)
            if reason is not None:
                why.setdefault(reason, []).append(n.name)
        detail = "; ".join(f"{', '.join(names[:5])}: {reason}" for reason, names in
                           why.items())
        return (f"{len(able)} of the {need} nodes it needs can take it"
                + (f" ({detail})" if detail else ""))

    def node_parts(self, job: Job, bundle: BundleRef | None) -> list[dict[str, Any]]:
        out = []
        for n in self.registry.all():
            alive = self.registry.is_alive(n)
            reason = eligibility(job, n, alive, bundle, self.studies)
            out.append({"node_id": n.node_id, "name": n.name,
                        "state": n.state if alive else "lost",
                        "eligible": reason is None, "reason": reason})
        return out

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

