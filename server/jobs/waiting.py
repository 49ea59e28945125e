"""What a job is doing now and why it waits, for the admin documents (`fedgpu job list`,
`job status` and their --json): computed from the running engines, the queue's view of busy
sites (server/jobs/scheduling.py) and each site's eligibility, never stored."""

from __future__ import annotations

from typing import Any, Protocol

from fedgpu.core.bundles import BundleRef
from fedgpu.core.constants import JobState, RunState
from fedgpu.core.job import Job
from fedgpu.server.jobs.seats import JobRoster
from fedgpu.server.jobs.state import JobRow
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.eligibility import eligibility


class Queue(Protocol):
    """What the documents read of the queue (server/jobs/queue.py's JobManager)."""

    registry: Registry
    running: dict[str, Any]  # job id -> its ActiveJob
    blocked: dict[str, str]
    max_concurrent: int

    def roster(self, job_id: str) -> JobRoster: ...


def live_state(jobs: Queue, row: JobRow) -> tuple[JobState, str | None]:
    """The job's state now, with the reason it waits."""
    active = jobs.running.get(row.job_id)
    if active is None:
        if row.state in (JobState.RUNNING, JobState.WAITING):
            # Its turn comes as soon as the aggregator's loop picks it up.
            return JobState.QUEUED, "resuming"
        if row.state is JobState.QUEUED and row.job_id in jobs.blocked:
            return JobState.QUEUED, jobs.blocked[row.job_id]
        if row.state is JobState.QUEUED and jobs.running:
            full = len(jobs.running) >= jobs.max_concurrent
            return JobState.QUEUED, ("after job " + ", ".join(jobs.running) if full
                                     else "starting")
        return row.state, row.reason
    if active.orch.state == RunState.WAITING or active.orch.waiting_for_nodes:
        return JobState.WAITING, waiting_reason(jobs, active.job, active.row.bundle,
                                                row.job_id)
    return JobState.RUNNING, None


def waiting_reason(jobs: Queue, job: Job, bundle: BundleRef | None,
                   job_id: str = "") -> str:
    registry = jobs.registry
    nodes = registry.all()
    roster = jobs.roster(job_id)
    reasons = {n.name: eligibility(job, n, registry.is_alive(n), bundle, roster)
               for n in nodes}
    able = [name for name, reason in reasons.items() if reason is None]
    need = job.min_available_nodes or job.min_nodes
    if len(able) >= need:
        return "starting"
    why: dict[str, list[str]] = {}
    for name, reason in reasons.items():
        if reason is not None:
            why.setdefault(reason, []).append(name)
    detail = "; ".join(f"{', '.join(names[:5])}: {reason}" for reason, names in why.items())
    return (f"{len(able)} of the {need} nodes it needs can take it"
            + (f" ({detail})" if detail else ""))


def node_parts(jobs: Queue, job: Job, bundle: BundleRef | None,
               job_id: str = "") -> list[dict[str, Any]]:
    out = []
    roster = jobs.roster(job_id)
    for n in jobs.registry.all():
        alive = jobs.registry.is_alive(n)
        reason = eligibility(job, n, alive, bundle, roster)
        out.append({"node_id": n.node_id, "name": n.name,
                    "state": n.state if alive else "lost",
                    "eligible": reason is None, "reason": reason})
    return out
