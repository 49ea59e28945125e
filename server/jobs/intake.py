"""Submitting jobs: a job file (with its task bundle and initial weights) checked, then
queued in the job database. The job manager (server/jobs/queue.py) holds one Intake; it is a
collaborator of its own because what an operator sends is where the aggregator's guard is:
every check here runs before anything is stored, `prepare` is pure so callers run it off the
event loop, and the queue has a length limit (--max-queued-jobs).

A job is parsed once, here, by the job schema (fedgpu/core/job/); what is stored is the
validated job (`Job.to_dict()`, the row's job_json), which the queue reads back through the
same schema. The file's text is kept beside it, as submitted, for people and provenance.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from fedgpu.core.bundles import Bundle, pack_dir
from fedgpu.core.constants import BUILTIN_TASKS, JobState
from fedgpu.core.errors import ConfigError, FedgpuError
from fedgpu.core.job import (
    MAX_JOB_FILE_BYTES,
    Job,
    for_submission,
    loads_toml,
    parse_job,
    read_job_file,
)
from fedgpu.core.suggest import did_you_mean
from fedgpu.proto import admin_pb2
from fedgpu.server.jobs import initial_weights as iw
from fedgpu.server.jobs import resume, submission
from fedgpu.server.jobs.bundles import BundleStore
from fedgpu.server.jobs.earlier import check_earlier
from fedgpu.server.jobs.state import JobRow, SavedHistory, StateStore
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.checkpoint import Checkpointer
from fedgpu.server.transfer.wire_limits import shown

log = logging.getLogger("fedgpu.server.jobs")

JOBS_DIR = "jobs"
DEFAULT_MAX_QUEUED = 100


# Submissions being received at once (each may hold a temporary file of initial weights).
MAX_IN_FLIGHT = 8
# Who submitted may refuse the parsed job (a researcher's job outside their studies): raises.
Admit = Callable[[Job], Awaitable[None]]


class QueueFull(FedgpuError):
    """--max-queued-jobs jobs already wait: a submission is refused until some have run."""


class TooManySubmissions(QueueFull):
    """MAX_IN_FLIGHT submissions are being received: another is refused until one is done."""


@dataclass
class Submitted:
    """A queued submission: its row, the job as parsed, and what its submitter should know
    (the job is queued all the same)."""

    row: JobRow
    job: Job
    warnings: list[str] = field(default_factory=list)


class Intake:
    """Checks and queues what operators submit. `running()` names the job the queue runs
    now (not counted against --max-queued-jobs); `queued()` tells the queue a job arrived."""

    def __init__(self, store: StateStore, registry: Registry, state_dir: Path,
                 bundles: BundleStore, *, running: Callable[[], str | None],
                 queued: Callable[[], None], max_queued: int = DEFAULT_MAX_QUEUED,
                 initial_weights_dir: Path | None = None,
                 max_initial_bytes: int = 4 << 30) -> None:
        self.store = store
        self.registry = registry
        self.state_dir = state_dir
        self.bundles = bundles
        self.max_queued = max_queued
        self.initial_weights_dir = initial_weights_dir
        # Initial weights are a model like any update: bounded by the update limit.
        self.max_initial_bytes = max_initial_bytes
        self._running = running
        self._queued = queued
        self.in_flight = 0

    def prepare(self, job_toml: str, filename: str, bundle: Bundle | None = None) -> Job:
        """Validate a job file (with the task bundle it came with, checked by the caller):
        the Job, or ConfigError naming the key. Pure, so callers run it off the event loop."""
        if len(job_toml.encode()) > MAX_JOB_FILE_BYTES:
            raise ConfigError(f"{filename}: the job file is larger than {MAX_JOB_FILE_BYTES} "
                              "bytes")
        job = parse_job(loads_toml(job_toml, filename), filename)
        job = for_submission(job, bundle.manifest.name if bundle is not None else None,
                             filename)
        from fedgpu.server.strategies import make_strategy

        make_strategy(job.strategy, job.strategy_params)  # bad [strategy_params] refused now
        return job

    def check_room(self) -> None:
        """QueueFull when --max-queued-jobs jobs already wait their turn (a COUNT: a full
        queue refusing a burst of submissions must not load every waiting row each time)."""
        waiting = self.store.count_pending(besides=self._running())
        if waiting >= self.max_queued:
            raise QueueFull(f"{waiting} jobs are already queued, the limit of this "
                            f"aggregator (--max-queued-jobs {self.max_queued}): wait for them "
                            "to run, or stop some with 'fedgpu job stop'")

    def submit(self, job_toml: str, filename: str, submitted_by: str,
               source: str = "submit", bundle: Bundle | None = None,
               weights: Path | None = None) -> JobRow:
        """Validate and queue a job file; ConfigError (naming the key) queues nothing.
        `weights`: the job's initial weights, received or copied to a temporary file (moved
        into the job's directory here); without them a job's `initial_weights` names a file
        of the aggregator's --initial-weights-dir."""
        return self.enqueue(self.prepare(job_toml, filename, bundle), job_toml, filename,
                            submitted_by, source, bundle, weights)

    def check_task_offered(self, job: Job, bundle: Bundle | None) -> None:
        """ConfigError when nodes are registered, none offers the job's task, it is no
        built-in task and no bundle brings it: a typo would otherwise wait forever. With no
        node registered yet the job is queued (it waits, saying why)."""
        if bundle is not None or job.task in BUILTIN_TASKS:
            return
        nodes = self.registry.all()
        offered = {t for n in nodes for t in n.tasks}
        # A node that lists no tasks (a simulated site) takes any, as eligibility reads it.
        if not nodes or job.task in offered or any(not n.tasks for n in nodes):
            return
        known = sorted(offered | set(BUILTIN_TASKS))
        hint = did_you_mean(job.task, known)
        raise ConfigError(f"no registered node offers task {shown(job.task)} and no task bundle "
                          f"came with the job{hint}; the tasks offered: {', '.join(known[:20])}"
                          + (", ..." if len(known) > 20 else ""))

    def enqueue(self, job: Job, job_toml: str, filename: str, submitted_by: str,
                source: str = "submit", bundle: Bundle | None = None,
                weights: Path | None = None) -> JobRow:
        """Queue a job `prepare` accepted (on the event loop: the database and the wake-up)."""
        try:
            if source == "submit":
                self.check_task_offered(job, bundle)
            self.check_room()
            check_earlier(self.store, job)
            if job.initial_weights is not None and weights is None:
                weights = self.weights_from_dir(job)
        except BaseException:
            if weights is not None:
                weights.unlink(missing_ok=True)
            raise
        ref = None
        if bundle is not None:
            self.bundles.put(bundle)
            ref = bundle.ref()
        job_id = secrets.token_hex(6)
        if weights is not None:
            iw.store(weights, self.state_dir / JOBS_DIR / job_id)
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
        short = self.shortfall(job)
        if short is not None:
            self.store.add_event(job_id, short, level="warning")
        self._queued()
        return row

    def shortfall(self, job: Job) -> str | None:
        """A warning when fewer sites are registered than the job needs: it is queued all the
        same (sites may still come), but its submitter learns now, not after queue_timeout_s."""
        need = job.min_available_nodes or job.min_nodes
        have = len(self.registry.all())
        if have >= need:
            return None
        key = "min_available_nodes" if job.min_available_nodes else "min_nodes"
        return (f"{key} = {need}, but {have} site(s) are registered on this aggregator: the "
                f"job waits for {need - have} more (and fails {job.queue_timeout_s:g} s after "
                "its turn comes if they do not register: queue_timeout_s)")

    async def receive(self, head: admin_pb2.SubmitJobHeader,
                      stream: AsyncIterator[admin_pb2.SubmitJobChunk],
                      submitted_by: str, admit: Admit | None = None) -> Submitted:
        """A submission from the wire: room checked before a byte more is read, the bundle
        and weights received (bounded), the job parsed once, `admit`ted (the submitter's
        role may refuse it: it raises) and queued. Nothing is left behind on any refusal."""
        self.check_room()
        if self.in_flight >= MAX_IN_FLIGHT:
            raise TooManySubmissions(f"{self.in_flight} job submissions are being received "
                                     "by this aggregator; try again when one is done")
        self.in_flight += 1
        try:
            return await self._receive(head, stream, submitted_by, admit)
        finally:
            self.in_flight -= 1

    async def _receive(self, head: admin_pb2.SubmitJobHeader,
                       stream: AsyncIterator[admin_pb2.SubmitJobChunk],
                       submitted_by: str, admit: Admit | None) -> Submitted:
        got = await submission.receive(head, stream, self.state_dir, self.max_initial_bytes)
        filename = (head.filename or "job.toml")[:256]
        weights = got.weights
        try:
            # Parsing (and a ring's mixing matrix) and copying weights run off the loop.
            job = await asyncio.to_thread(self.prepare, head.job_toml, filename, got.bundle)
            if admit is not None:
                await admit(job)
            if weights is None and job.initial_weights is not None:
                weights = await asyncio.to_thread(self.weights_from_dir, job)
            row = self.enqueue(job, head.job_toml, filename, submitted_by, bundle=got.bundle,
                               weights=weights)
        except BaseException:
            if weights is not None:
                weights.unlink(missing_ok=True)
            raise
        short = self.shortfall(job)
        return Submitted(row, job, [short] if short else [])

    def weights_from_dir(self, job: Job) -> Path:
        """A temporary copy of the job's `initial_weights` from --initial-weights-dir (file
        I/O: run it in a thread when on the event loop)."""
        assert job.initial_weights is not None
        weights = iw.incoming_path(self.state_dir)
        iw.from_serving_dir(self.initial_weights_dir, job.initial_weights, weights,
                            self.max_initial_bytes)
        return weights

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
            wanted = read_job_file(start_file)
            if all(getattr(wanted.job, k) == getattr(job, k) for k in resume.MUST_MATCH):
                text, source, job = wanted.text, "server-start", wanted.job
                digest = hashlib.sha256(text.encode()).hexdigest()
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
        # The history as that version kept it (in state.json); the job's checkpoint reads
        # the same again when the job resumes (server/jobs/job_checkpoint.py).
        self.store.save_history(job_id, SavedHistory.from_state(state))
        self.store.add_event(job_id, f"adopted run {state.get('run_id')} (round "
                             f"{state.get('global_round')}) from {legacy}")
        log.info("state directory %s held run %s from before jobs: it is job %s now",
                 self.state_dir, state.get("run_id"), job_id)
        del weights  # loaded only to check the checkpoint is whole before moving it
        return self.store.get(job_id)

    def submit_at_start(self, path: Path) -> JobRow:
        """`server start --job FILE`: queue it, unless this very file was queued by an earlier
        start on this state directory (a restarted container must not queue it again)."""
        jf = read_job_file(path)
        text = jf.text
        digest = hashlib.sha256(text.encode()).hexdigest()
        earlier = self.store.find_source("server-start", digest)
        if earlier is not None:
            log.info("job file %s was queued before as job %s (%s); not queued again",
                     path, earlier.job_id, earlier.state)
            return earlier
        bundle = weights = None
        if jf.task_dir is not None:
            # Relative to the job file, as `fedgpu job submit` reads it.
            bundle = pack_dir(jf.task_dir)
        if jf.initial_weights is not None:
            # The host's own job file, given by whoever started the server: its path is read,
            # as `fedgpu job submit` reads it (a regular file, within the update limit).
            weights = iw.incoming_path(self.state_dir)
            try:
                source = jf.initial_weights
                iw.copy_regular(source, weights, self.max_initial_bytes,
                                f"initial_weights {source}")
                iw.check(weights, f"initial_weights {source}")
            except BaseException:
                weights.unlink(missing_ok=True)
                raise
        return self.submit(text, str(path), "server start --job", source="server-start",
                           bundle=bundle, weights=weights)
