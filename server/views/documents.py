"""The documents the CLI's `--json` prints and the dashboard reads, made in one place:
`fedgpu status|nodes|rounds` (of the current job, or any job by id) and `fedgpu job
list|status`. The Admin service and the dashboard both call these."""

from __future__ import annotations

import time
from typing import Any

import fedgpu
from fedgpu.core import cross_site_matrix as cross_site
from fedgpu.core.constants import JobState, Mode
from fedgpu.server.jobs.job_engine import job_from_row
from fedgpu.server.jobs.queue import JobManager
from fedgpu.server.jobs.state import JobRow, SavedHistory
from fedgpu.server.registry import Registry
from fedgpu.server.rounds import device_time
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.plans import KIND_NAMES
from fedgpu.server.transfer.uploads import Uploads
from fedgpu.server.views import evaluation, privacy, statistics
from fedgpu.server.views.round_progress import open_round

# `status --json` `state` when no job has ever been submitted.
IDLE = "idle"


def current_round(orch: Orchestrator) -> dict[str, Any] | None:
    rnd = orch.current
    if rnd is None:
        return None
    return {
        "round": rnd.number,
        "kind": KIND_NAMES.get(rnd.kind, "?"),
        "attempt": rnd.attempt,
        "participants": len(rnd.slots),
        "accepted": rnd.accepted(),
        "outstanding": rnd.outstanding(),
        "deadline_in_s": round(max(0.0, rnd.deadline - time.time()), 1),
    }


def _bulk(uploads: Uploads | None) -> dict[str, Any] | None:
    """The bulk port's figures (`status --json` `bulk`); None without a bulk port."""
    return uploads.bulk() if uploads is not None and uploads.bulk is not None else None


def _nodes_count(registry: Registry) -> dict[str, int]:
    return {"registered": len(registry.all()), "alive": len(registry.alive())}


def status_doc(orch: Orchestrator, registry: Registry, job_id: str | None = None,
               uploads: Uploads | None = None) -> dict[str, Any]:
    """A job's run as its engine sees it (the running job, or one ended in this process)."""
    latest = orch.history.latest_eval()
    return {
        "run_id": orch.run_id,
        "job_id": job_id,
        "state": orch.state,
        "error": orch.error,
        "task": orch.job.task,
        "mode": orch.job.mode,
        "strategy": orch.job.strategy,
        "round": orch.global_round,
        "rounds": orch.job.rounds,
        "current_round": current_round(orch),
        "nodes": _nodes_count(registry),
        "accuracy": None if latest is None else latest.accuracy,
        "loss": None if latest is None else latest.loss,
        "rejections": dict(orch.rejections),
        # Update streams being received now: stalled ones, those timed out so far, memory.
        "uploads": uploads.stats() if uploads is not None else None,
        "bulk": _bulk(uploads),
        "started_at": orch.started_at,
        "finished_at": orch.finished_at,
        "uptime_s": round(time.time() - orch.started_at, 1),
        "job": orch.job.to_dict(),
        "version": fedgpu.__version__,
    }


def _stored_status(jobs: JobManager, row: JobRow) -> dict[str, Any]:
    """A job's status from the database: queued, or ended before this process started."""
    state, _ = jobs.live_state(row)
    started = row.started_at or row.submitted_at
    return {
        "run_id": row.run_id,
        "job_id": row.job_id,
        "state": str(state),
        "error": row.error,
        "task": row.task,
        "mode": row.job.get("mode"),
        "strategy": row.job.get("strategy"),
        "round": row.rounds_done,
        "rounds": row.rounds,
        "current_round": None,
        "nodes": _nodes_count(jobs.registry),
        "accuracy": row.accuracy,
        "loss": row.loss,
        "rejections": jobs.store.rejections(row.job_id),
        "uploads": jobs.uploads.stats() if jobs.uploads is not None else None,
        "bulk": _bulk(jobs.uploads),
        "started_at": started,
        "finished_at": row.finished_at,
        "uptime_s": round((row.finished_at or time.time()) - started, 1),
        "job": row.job,
        "version": fedgpu.__version__,
    }


def _engine(jobs: JobManager, job_id: str) -> Orchestrator | None:
    if job_id in jobs.running:
        return jobs.running[job_id].orch
    held = jobs.last
    return held.orch if held is not None and held.row.job_id == job_id else None


def status_of(jobs: JobManager, job_id: str = "") -> dict[str, Any]:
    """`fedgpu status [--job ID] --json`: the given job, else the running one, else the
    latest; `state` "idle" when there has never been a job."""
    if not job_id:
        held = jobs.active or jobs.last
        if held is not None:
            return _with_budget(jobs, status_doc(held.orch, jobs.registry, held.row.job_id,
                                                 jobs.uploads))
        rows = jobs.store.jobs(limit=1)
        if not rows:
            return {"run_id": None, "job_id": None, "state": IDLE, "error": None,
                    "task": None, "mode": None, "strategy": None, "round": 0, "rounds": 0,
                    "current_round": None, "nodes": _nodes_count(jobs.registry),
                    "accuracy": None, "loss": None, "rejections": {},
                    "uploads": jobs.uploads.stats() if jobs.uploads is not None else None,
                    "bulk": _bulk(jobs.uploads),
                    "started_at": None,
                    "finished_at": None, "uptime_s": 0.0, "job": None,
                    "version": fedgpu.__version__}
        job_id = rows[0].job_id
    engine = _engine(jobs, job_id)
    if engine is not None:
        return _with_budget(jobs, status_doc(engine, jobs.registry, job_id, jobs.uploads))
    return _with_budget(jobs, _stored_status(jobs, jobs.get(job_id)))


def _with_budget(jobs: JobManager, doc: dict[str, Any]) -> dict[str, Any]:
    """Why the job ended (`reason`, e.g. "privacy budget spent after 9 rounds, epsilon 7.59 of
    8") and, for a job with [privacy], the epsilon spent of its target."""
    row = jobs.get(doc["job_id"])
    doc["reason"] = jobs.live_state(row)[1]
    if row.job.get("privacy"):
        full = privacy.summary(row.job, _round_dicts(jobs, row.job_id)) or {}
        doc["privacy"] = {k: full.get(k) for k in ("mode", "target_epsilon", "delta",
                                                   "epsilon_spent", "rounds_accounted")}
    if row.job.get("mode") == Mode.STATISTICS:  # the dashboard's Statistics panel reads it
        doc["statistics"] = statistics.summary(_round_dicts(jobs, row.job_id))
    if row.job.get("mode") == Mode.CROSS_SITE:  # the dashboard's cross-site panel reads it
        doc["cross_site"] = cross_site.matrix(_round_dicts(jobs, row.job_id))
    return doc


def rounds_of(jobs: JobManager, job_id: str = "") -> dict[str, Any]:
    """`fedgpu rounds [--job ID] --json`, with the job's device time so far and, while a
    round is open, each site's transfer progress (`open`, server/views/round_progress.py)."""
    doc = _rounds_of(jobs, job_id)
    doc["device_seconds"] = device_time.summary(doc.get("rounds") or ())
    engine = _engine(jobs, doc.get("job_id") or "") if doc.get("job_id") else None
    progress = open_round(engine, jobs.uploads, jobs.downloads) if engine is not None else None
    if progress is not None:
        doc["open"] = progress
    return doc


def _rounds_of(jobs: JobManager, job_id: str) -> dict[str, Any]:
    if not job_id:
        held = jobs.active or jobs.last
        if held is not None:
            return {**held.orch.rounds_doc(), "job_id": held.row.job_id}
        rows = jobs.store.jobs(limit=1)
        if not rows:
            return {"run_id": None, "job_id": None, "initial_eval": None, "rounds": []}
        job_id = rows[0].job_id
    engine = _engine(jobs, job_id)
    if engine is not None:
        return {**engine.rounds_doc(), "job_id": job_id}
    row = jobs.get(job_id)
    # As far as its checkpoint went (rounds_done is written after it): a crash between the
    # two writes leaves a round in the history that the job runs again on resume.
    saved = (jobs.store.history(job_id) or SavedHistory()).upto(row.rounds_done)
    return {"run_id": row.run_id, "job_id": job_id, "initial_eval": saved.initial_eval,
            "rounds": saved.records}


def nodes_doc(registry: Registry, only: frozenset[str] | None = None) -> dict[str, Any]:
    """`fedgpu nodes --json`; `only`: the names a node's certificate may see (itself)."""
    nodes = registry.snapshot()
    if only is not None:
        nodes = [n for n in nodes if n["name"] in only]
    return {"nodes": nodes}


def job_summary(jobs: JobManager, row: JobRow) -> dict[str, Any]:
    """One `fedgpu job list --json` entry, with the state as it is now."""
    doc = row.summary()
    state, reason = jobs.live_state(row)
    doc["state"], doc["reason"] = str(state), reason
    engine = _engine(jobs, row.job_id)
    if engine is not None and state in (JobState.RUNNING, JobState.WAITING):
        doc["rounds_done"] = engine.global_round
        latest = engine.history.latest_eval()
        if latest is not None:
            doc["accuracy"], doc["loss"] = latest.accuracy, latest.loss
    return doc


def jobs_doc(jobs: JobManager) -> list[dict[str, Any]]:
    """`fedgpu job list --json`: every job, oldest first."""
    return [job_summary(jobs, row) for row in jobs.store.jobs()]


def job_doc(jobs: JobManager, job_id: str) -> dict[str, Any]:
    """`fedgpu job status ID --json`: the list entry plus the open round, each node's part
    (or why it has none), the run id and the parsed job."""
    row = jobs.get(job_id)
    doc = job_summary(jobs, row)
    active = jobs.running.get(job_id)
    engine = active.orch if active is not None else None
    doc["current_round"] = current_round(engine) if engine is not None else None
    doc["run_id"] = engine.run_id if engine is not None else row.run_id
    doc["nodes"] = [] if row.ended else jobs.node_parts(job_from_row(row), row.bundle,
                                                             row.job_id)
    doc["job"] = row.job
    rounds = _round_dicts(jobs, job_id)
    doc["device_seconds"] = device_time.summary(rounds)
    if row.job.get("privacy"):
        doc["privacy"] = privacy.summary(row.job, rounds)
    if row.job.get("secure_aggregation"):
        doc["masked_metrics"] = last_masked_metrics(jobs, job_id)
    if row.job.get("mode") == Mode.EVALUATE:
        doc["evaluation"] = evaluation.summary(rounds)
    if row.job.get("mode") == Mode.STATISTICS:
        doc["statistics"] = statistics.summary(rounds)
    if row.job.get("mode") == Mode.CROSS_SITE:
        doc["cross_site"] = cross_site.matrix(rounds)
    return doc


def last_masked_metrics(jobs: JobManager, job_id: str) -> dict[str, Any] | None:
    """The last finished secure round's sums of the sites' training numbers (they left the
    sites masked: server/secagg/plan.py), as {"round": N, name: value}; None before one."""
    for rec in reversed(_round_dicts(jobs, job_id)):
        sums = rec.get("masked_metrics")
        if rec.get("status") == "finished" and sums:
            return {"round": rec.get("round"), **{k: v.get("value") for k, v in sums.items()}}
    return None


def _round_dicts(jobs: JobManager, job_id: str) -> list[dict[str, Any]]:
    """The job's round records: the engine's while it is held, else the stored ones (a job
    from before the aggregator's restart, or older than the last)."""
    held = _engine(jobs, job_id)
    if held is not None:
        return held.history.dicts()
    return (jobs.store.history(job_id) or SavedHistory()).records
