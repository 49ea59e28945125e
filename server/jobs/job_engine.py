"""A job's round engine, built from its row in the state store: the job read back through the
schema, the plan its mode runs, its checkpoint (a restarted job resumes from it) and its
starting weights. The queue (server/jobs/queue.py) decides when; this decides what runs."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from fedgpu.core.constants import Mode
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Job, loads_toml, parse_job, with_bundle_task
from fedgpu.server.jobs import initial_weights as iw
from fedgpu.server.jobs import resume
from fedgpu.server.jobs.earlier import earlier_model
from fedgpu.server.jobs.job_checkpoint import JobCheckpoint
from fedgpu.server.jobs.seats import JobRoster
from fedgpu.server.jobs.state import JobRow, StateStore
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.buffered import AsyncPlan
from fedgpu.server.rounds.cross_site import CrossSitePlan
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.plans import TrainPlan
from fedgpu.server.rounds.ring import RingPlan
from fedgpu.server.rounds.scoring import ScorePlan
from fedgpu.server.rounds.statistics import StatsPlan
from fedgpu.server.secagg.plan import SecAggPlan

# The queue's logger: these lines were always the queue's own.
log = logging.getLogger("fedgpu.server.jobs.queue")


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


def starting_weights(store: StateStore, state_dir: Path, row: JobRow, job: Job
                     ) -> dict[str, np.ndarray] | None:
    """The model the job starts from: an earlier job's, the file submitted with it, or None
    (a node builds the initial model)."""
    if job.model_from_job is not None:
        return earlier_model(store, state_dir, job.model_from_job)
    return iw.for_run(state_dir / row.state_dir, job.initial_weights, row.job_id)


def plan_for(job: Job) -> TrainPlan | None:
    """The training plan the job's mode runs (None: the engine's own, a star round)."""
    return (StatsPlan(job) if job.mode == Mode.STATISTICS
            else RingPlan(job) if job.mode == Mode.RING
            else SecAggPlan(job) if job.secure_aggregation
            else AsyncPlan(job) if job.mode == Mode.ASYNC
            else ScorePlan(job) if job.mode == Mode.EVALUATE
            else CrossSitePlan(job) if job.mode == Mode.CROSS_SITE
            else None)


def build_engine(row: JobRow, job: Job, initial: dict[str, np.ndarray] | None, *,
                 store: StateStore, registry: Registry, state_dir: Path, chunk_size: int,
                 roster: JobRoster) -> Orchestrator:
    """The job's engine, restored from its checkpoint when it has one (ConfigError when the
    checkpoint and the job disagree)."""
    directory = state_dir / row.state_dir
    checkpointer = JobCheckpoint(directory, store, row.job_id)
    saved = checkpointer.load()
    if saved is not None:
        resume.check(job, saved[0], saved[1], initial, directory)
    orch = Orchestrator(job, registry, chunk_size=chunk_size, checkpointer=checkpointer,
                        # Statistics: no model; an empty one skips the init round.
                        initial_weights={} if job.mode == Mode.STATISTICS else initial,
                        plan=plan_for(job), bundle=row.bundle, job_id=row.job_id,
                        roster=roster)
    if saved is not None:
        orch.restore(*saved)
        store.add_event(row.job_id, f"resumed after round {orch.global_round}")
    return orch
