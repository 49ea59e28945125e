"""The final model of an earlier job, for a job that scores it (`model_from_job`,
mode = "evaluate"): checked when the job is submitted (the job exists and ran the same task)
and read from that job's checkpoint when the job starts (it must have finished by then: jobs
run in order, so one submitted after it finds it ended)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedgpu.core.constants import JobState
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Job
from fedgpu.server.jobs.state import JobRow, StateStore
from fedgpu.server.rounds.checkpoint import Checkpointer


def _row(store: StateStore, job_id: str) -> JobRow:
    row = store.get(job_id)
    if row is None:
        raise ConfigError(f"model_from_job: no job {job_id!r} on this aggregator (see 'fedgpu "
                          "job list')")
    return row


def check_earlier(store: StateStore, job: Job) -> None:
    """At submission: ConfigError unless `job.model_from_job` names a job of the same task
    that has not failed or been stopped (it may still be queued or running)."""
    if job.model_from_job is None:
        return
    row = _row(store, job.model_from_job)
    if row.task != job.task:
        raise ConfigError(f"model_from_job: job {row.job_id} ran task {row.task!r}, not "
                          f"{job.task!r}: its model does not fit this job's task")
    if row.ended and row.state is not JobState.FINISHED:
        raise ConfigError(f"model_from_job: job {row.job_id} {row.state.value}, so it has no "
                          "final model; download the model it left with 'fedgpu job model' "
                          "and give it as 'initial_weights'")


def earlier_model(store: StateStore, state_dir: Path, job_id: str) -> dict[str, np.ndarray]:
    """At start: the final model of finished job `job_id`, from its checkpoint."""
    row = _row(store, job_id)
    if row.state is not JobState.FINISHED:
        raise ConfigError(f"model_from_job: job {job_id} is {row.state.value}, not finished: "
                          "it has no final model to score")
    loaded = Checkpointer(state_dir / row.state_dir).load()
    if loaded is None:
        raise ConfigError(f"model_from_job: job {job_id} left no model (its checkpoint is "
                          "gone: removed by the aggregator's retention?)")
    return dict(loaded[0])
