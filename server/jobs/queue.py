"""Jobs on a federation that stays up: a queue, run one at a time in submission order.

The federation (who is connected: the registry) outlives its jobs; each job is an object of
its own with its round engine (an orchestrator), strategy and checkpoints, in
`<state dir>/jobs/<job id>/`. The job list, states, events and round history are in SQLite
(fedgpu.server.jobs.store), so a restarted aggregator finds its queue again: queued jobs stay
queued, the job that was running resumes from its last finished round, finished jobs stay
listed with their models downloadable.

Running several jobs at once would be a change of policy here (`_next`), not of the jobs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core import codec
from fedgpu.core.bundles import Bundle, BundleRef, pack_dir
from fedgpu.core.config import MAX_JOB_FILE_BYTES, Job, parse_job, with_bundle_task
from fedgpu.core.constants import JobState, Mode, RunState
from fedgpu.core.errors import ConfigError, FedgpuError
from fedgpu.proto import pb
from fedgpu.server.jobs import resume
from fedgpu.server.jobs.bundles import BundleStore, offers_of
from fedgpu.server.jobs.checkpoint import Checkpointer, SavedWeights
from fedgpu.server.jobs.store import JobRow, JobStore
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.buffered import AsyncPlan
from fedgpu.server.rounds.eligibility import eligibility
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.ring import RingPlan

log = logging.getLogger("fedgpu.server.jobs.queue")

JOBS_DIR = "jobs"
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


class StoreCheckpointer(Checkpointer):
    """Checkpoints a job's round as before (weights + state.json, atomically), then copies its
    history and progress into the job database, so listings never need the checkpoint."""

    def __init__(self, directory: Path, store: JobStore, job_id: str) -> None:
        super().__init__(directory)
        self.store = store
        self.job_id = job_id

    def save(self, weights: Any, state: Any, tensors: Any = None,
             same_as: SavedWeights | None = None) -> SavedWeights:
        saved = super().save(weights, state, tensors, same_as)
        history = list(state.get("history") or [])
        self.store.save_history(self.job_id, history, state.get("initial_eval"),
                                state.get("rejections"))
        latest = next((h["eval"] for h in reversed(history) if h.get("eval")), None) or {}
        self.store.update(self.job_id, rounds_done=int(state.get("global_round", 0)),
                          accuracy=latest.get("accuracy"), loss=latest.get("loss"),
                          run_id=str(state.get("run_id")))
        return saved


def job_from_row(row: JobRow) -> Job:
    # The file as submitted, parsed by this version; a job adopted from an old state
    # directory has no file, only the job as that version parsed it.
    raw = tomllib.loads(row.job_toml) if row.job_toml else dict(row.job)
    job = parse_job(raw, f"job {row.job_id}")
    return with_bundle_task(job, row.bundle_name or row.task) if row.bundle_sha256 else job


class JobManager:
    def __init__(self, store: JobStore, registry: Registry, state_dir: Path,
                 chunk_size: int) -> None:
        self.store = store
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

    # ---- submitting ------------------------------------------------------------------

    def submit(self, job_toml: str, filename: str, submitted_by: str,
               source: str = "submit", bundle: Bundle | None = None) -> JobRow:
        """Validate and queue a job file (with the task bundle it came with, checked by the
        caller); ConfigError (naming the key) queues nothing."""
        if len(job_toml.encode()) > MAX_JOB_FILE_BYTES:
            raise ConfigError(f"{filename}: the job file is larger than {MAX_JOB_FILE_BYTES} "
                              "bytes")
        try:
            raw = tomllib.loads(job_toml)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{filename}: not valid TOML: {exc}") from None
        job = parse_job(raw, filename)
        if bundle is not None:
            job = with_bundle_task(job, bundle.manifest.name, filename)
        elif job.task_dir is not None:
            raise ConfigError(f"{filename}: 'task_dir' names a task bundle directory, but no "
                              "bundle came with the job: submit it with 'fedgpu job submit' "
                              "(which packs the directory and sends it)")
        from fedgpu.server.strategies import make_strategy

        make_strategy(job.strategy, job.strategy_params)  # bad [strategy_params] refused now
        ref = None
        if bundle is not None:
            self.bundles.put(bundle)
            ref = bundle.ref()
        job_id = secrets.token_hex(6)
        row = self.store.add_job(
            job_id=job_id, name=job.name or job.task, task=job.task, job_toml=job_toml,
            job=job.to_dict(), source=source,
            source_sha256=hashlib.sha256(job_toml.encode()).hexdigest(),
            submitted_by=submitted_by, rounds=job.rounds, state_dir=f"{JOBS_DIR}/{job_id}",
            bundle=ref)
        carried = (f" (bundle {ref.sha256}, {ref.size} bytes, entry {ref.entry})"
                   if ref is not None else "")
        self.store.add_event(job_id, f"submitted by {submitted_by} from {filename}: task "
                             f"{job.task}{carried}, {job.rounds} rounds, {job.strategy}")
        log.info("job %s queued (%s, task %s%s)", job_id, row.name, job.task, carried)
        self._offers = None
        self._wake.set()
        return row

    def adopt_legacy(self, start_file: Path | None) -> JobRow | None:
        """A state directory from before jobs (one run: state.json and its weights at the
        top) becomes this aggregator's first job, moved into its own job directory, so an
        upgraded aggregator resumes the run it was in. When `server start --job` names a file
        for the same model, the job is that file's (and that file is not queued again)."""
        legacy = self.state_dir / "state.json"
        if not legacy.exists() or self.store.jobs(limit=1):
            return None
        saved = Checkpointer(self.state_dir).load()
        assert saved is not None
        weights, state = saved
        job = parse_job(dict(state.get("job") or {}), f"{legacy}")
        text, source, digest = "", "migrated", ""
        if start_file is not None:
            candidate = start_file.read_text()
            wanted = parse_job(tomllib.loads(candidate), str(start_file))
            if all(getattr(wanted, k) == getattr(job, k) for k in resume.MUST_MATCH):
                text, source, job = candidate, "server-start", wanted
                digest = hashlib.sha256(candidate.encode()).hexdigest()
        job_id = secrets.token_hex(6)
        directory = self.state_dir / JOBS_DIR / job_id
        directory.mkdir(parents=True)
        moved = [self.state_dir / str(state.get("weights_file") or "global.safetensors"),
                 self.state_dir / "strategy.safetensors", legacy]
        for path in moved:  # state.json last: it is the commit point of the checkpoint
            if path.exists():
                os.replace(path, directory / path.name)
        for leftover in self.state_dir.glob("global*.safetensors"):
            leftover.unlink()
        # The stable name of the latest model, as the checkpointer keeps it.
        os.link(directory / moved[0].name, directory / "global.safetensors")
        self.store.add_job(
            job_id=job_id, name=job.name or job.task, task=job.task, job_toml=text,
            job=job.to_dict(), source=source, source_sha256=digest,
            submitted_by="the state directory of an earlier version", rounds=job.rounds,
            state_dir=f"{JOBS_DIR}/{job_id}")
        self.store.update(job_id, run_id=str(state.get("run_id")),
                          rounds_done=int(state.get("global_round", 0)))
        if state.get("completed"):
            self.store.update(job_id, state=JobState.FINISHED, finished_at=time.time())
        self.store.save_history(job_id, list(state.get("history") or []),
                                state.get("initial_eval"), state.get("rejections"))
        self.store.add_event(job_id, f"adopted run {state.get('run_id')} (round "
                             f"{state.get('global_round')}) from {legacy}")
        log.info("state directory %s held run %s from before jobs: it is job %s now",
                 self.state_dir, state.get("run_id"), job_id)
        del weights  # loaded only to check the checkpoint is whole before moving it
        return self.store.get(job_id)

    def submit_at_start(self, path: Path) -> JobRow:
        """`server start --job FILE`: queue it, unless this very file was queued by an earlier
        start on this state directory (a restarted container must not queue it again)."""
        text = path.read_text()
        digest = hashlib.sha256(text.encode()).hexdigest()
        earlier = self.store.find_source("server-start", digest)
        if earlier is not None:
            log.info("job file %s was queued before as job %s (%s); not queued again",
                     path, earlier.job_id, earlier.state)
            return earlier
        bundle = None
        task_dir = parse_job(tomllib.loads(text), str(path)).task_dir
        if task_dir is not None:
            # Relative to the job file, as `fedgpu job submit` reads it.
            bundle = pack_dir(path.parent / task_dir)
        return self.submit(text, str(path), "server start --job", source="server-start",
                           bundle=bundle)

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
        row = self.store.get(job_id)
        if row is None:
            raise JobError(f"no job {job_id!r} on this aggregator; 'fedgpu job list' shows "
                           "the jobs")
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
            orch = self._orchestrator(row, job)
        except FedgpuError as exc:
            self._end(row.job_id, JobState.FAILED, str(exc))
            return
        task = asyncio.create_task(orch.run(), name=f"job-{row.job_id}")
        self.active = ActiveJob(row, job, orch, task)
        if not row.started_at:
            self.store.update(row.job_id, started_at=time.time())
        self.store.update(row.job_id, state=JobState.RUNNING, run_id=orch.run_id)
        self.store.add_event(row.job_id, f"started (run {orch.run_id})")
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
        active, self.active = self.active, None
        self.last = active
        for node in self.registry.all():
            # Nodes drop whatever the ended job had handed them (a stopped job's open round).
            node.pending = None
        state = {RunState.FINISHED: JobState.FINISHED, RunState.FAILED: JobState.FAILED}.get(
            orch.state, JobState.STOPPED)
        if active.stop_requested:
            state = JobState.STOPPED
        self._end(row.job_id, state, orch.error)

    def _end(self, job_id: str, state: JobState, error: str | None) -> None:
        self.store.update(job_id, state=state, error=error, reason=None,
                          finished_at=time.time())
        self._offers = None
        self.store.add_event(job_id, f"{state}" + (f": {error}" if error else ""),
                             level="error" if state is JobState.FAILED else "info")
        log.info("job %s %s%s", job_id, state, f": {error}" if error else "")

    def _orchestrator(self, row: JobRow, job: Job) -> Any:
        directory = self.state_dir / row.state_dir
        checkpointer = StoreCheckpointer(directory, self.store, row.job_id)
        initial = _initial_weights(job)
        saved = checkpointer.load()
        if saved is not None:
            resume.check(job, saved[0], saved[1], initial, directory)
        orch = Orchestrator(job, self.registry, chunk_size=self.chunk_size,
                            checkpointer=checkpointer, initial_weights=initial,
                            plan=(RingPlan(job) if job.mode == Mode.RING
                                  else AsyncPlan(job) if job.mode == Mode.ASYNC else None),
                            bundle=row.bundle, job_id=row.job_id)
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
                if eligibility(job, n, self.registry.is_alive(n), bundle) is None]
        need = job.min_available_nodes or job.min_nodes
        if len(able) >= need:
            return "starting"
        why = {}
        for n in nodes:
            reason = eligibility(job, n, self.registry.is_alive(n), bundle)
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
            reason = eligibility(job, n, alive, bundle)
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


def _initial_weights(job: Job) -> dict[str, np.ndarray] | None:
    if job.initial_weights is None:
        return None
    path = Path(job.initial_weights)
    try:
        tensors, _ = codec.decode(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"initial_weights {path} does not exist on the aggregator") from None
    except codec.CodecError as exc:
        raise ConfigError(f"initial_weights {path} is not a safetensors file: {exc}") from None
    return dict(tensors)
