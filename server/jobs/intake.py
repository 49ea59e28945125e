"""Submitting jobs: a job file (with its task bundle and initial weights) checked, then
queued in the job database. Part of the job manager (server/jobs/queue.py), kept apart because
what an operator sends is where the aggregator's guard is: every check here runs before
anything is stored, `prepare` is pure so callers run it off the event loop, and the queue has
a length limit (--max-queued-jobs).
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import logging
import os
import secrets
import time
import tomllib
from pathlib import Path
from typing import Any

from fedgpu.core import task_schemas
from fedgpu.core.bundles import Bundle, pack_dir
from fedgpu.core.config import MAX_JOB_FILE_BYTES, Job, loads_toml, parse_job, with_bundle_task
from fedgpu.core.constants import BUILTIN_TASKS, JobState
from fedgpu.core.errors import ConfigError, FedgpuError
from fedgpu.server.jobs import initial_weights as iw
from fedgpu.server.jobs import resume
from fedgpu.server.jobs.bundles import BundleStore
from fedgpu.server.jobs.state import JobRow, SavedHistory, StateStore
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.checkpoint import Checkpointer
from fedgpu.server.transfer.wire_limits import shown

log = logging.getLogger("fedgpu.server.jobs")

JOBS_DIR = "jobs"
DEFAULT_MAX_QUEUED = 100


class QueueFull(FedgpuError):
    """--max-queued-jobs jobs already wait: a submission is refused until some have run."""


class JobIntake:
    """The submitting half of JobManager (its attributes are the manager's)."""

    store: StateStore
    registry: Registry
    state_dir: Path
    bundles: BundleStore
    active: Any
    max_queued: int
    initial_weights_dir: Path | None
    max_initial_bytes: int
    _offers: Any
    _wake: asyncio.Event

    def prepare(self, job_toml: str, filename: str, bundle: Bundle | None = None) -> Job:
        """Validate a job file (with the task bundle it came with, checked by the caller):
        the Job, or ConfigError naming the key. Pure, so callers run it off the event loop."""
        if len(job_toml.encode()) > MAX_JOB_FILE_BYTES:
            raise ConfigError(f"{filename}: the job file is larger than {MAX_JOB_FILE_BYTES} "
                              "bytes")
        job = parse_job(loads_toml(job_toml, filename), filename)
        if bundle is not None:
            job = with_bundle_task(job, bundle.manifest.name, filename)
        elif job.task_dir is not None:
            raise ConfigError(f"{filename}: 'task_dir' names a task bundle directory, but no "
                              "bundle came with the job: submit it with 'fedgpu job submit' "
                              "(which packs the directory and sends it)")
        else:
            # A built-in task's hyperparameters, checked as its nodes would (names, kinds).
            task_schemas.check(job.task, job.hyperparameters, filename)
        from fedgpu.server.strategies import make_strategy

        make_strategy(job.strategy, job.strategy_params)  # bad [strategy_params] refused now
        return job

    def check_room(self) -> None:
        """QueueFull when --max-queued-jobs jobs already wait their turn."""
        waiting = [r for r in self.store.pending()
                   if self.active is None or r.job_id != self.active.row.job_id]
        if len(waiting) >= self.max_queued:
            raise QueueFull(f"{len(waiting)} jobs are already queued, the limit of this "
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
        close = difflib.get_close_matches(job.task, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
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
        self._offers = None
        self._wake.set()
        return row

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
        text = path.read_text()
        digest = hashlib.sha256(text.encode()).hexdigest()
        earlier = self.store.find_source("server-start", digest)
        if earlier is not None:
            log.info("job file %s was queued before as job %s (%s); not queued again",
                     path, earlier.job_id, earlier.state)
            return earlier
        bundle = weights = None
        job = parse_job(loads_toml(text, str(path)), str(path))
        if job.task_dir is not None:
            # Relative to the job file, as `fedgpu job submit` reads it.
            bundle = pack_dir(path.parent / job.task_dir)
        if job.initial_weights is not None:
            # The host's own job file, given by whoever started the server: its path is read,
            # as `fedgpu job submit` reads it (a regular file, within the update limit).
            weights = iw.incoming_path(self.state_dir)
            try:
                source = path.parent / job.initial_weights
                iw.copy_regular(source, weights, self.max_initial_bytes,
                                f"initial_weights {source}")
                iw.check(weights, f"initial_weights {source}")
            except BaseException:
                weights.unlink(missing_ok=True)
                raise
        return self.submit(text, str(path), "server start --job", source="server-start",
                           bundle=bundle, weights=weights)
