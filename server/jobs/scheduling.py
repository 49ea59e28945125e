"""Which queued job starts next when several may run at once (`--max-concurrent-jobs`).

Jobs start in submission order. A job starts when enough sites it may use (its study, its
task, its bundle's approval, its [resources]) are free of the running jobs; one whose sites
are busy stays queued with the reason ("needs 3 sites of study onco; 2 busy with job 4f2a
(site-a: 1 of 1 slot; site-b: 2 of 2 slots)": each busy site's slots, `node start --slots`),
and a later job may start before it only on sites it does not want: a job is never starved by
the ones queued behind it. A job that not even an idle federation has enough sites for starts
as it always did: it waits, says why, and fails after its queue_timeout_s.

With one job at a time this is never asked: the oldest queued job starts when none runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Job
from fedgpu.server.jobs.seats import Seats
from fedgpu.server.jobs.state import JobRow
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.eligibility import eligibility

# A waiting job's reason names this many busy sites' slots, then counts the rest.
MAX_SITES_NAMED = 3


class Queue(Protocol):
    """What the choice reads of the queue (server/jobs/queue.py's JobManager)."""

    registry: Registry
    seats: Seats
    studies: Any


def next_job(pending: list[JobRow], jobs: Queue, job_from_row: Callable[[JobRow], Job]
             ) -> tuple[JobRow | None, dict[str, str]]:
    """The job to start now (None: none can), and why each job before it waits."""
    blocked: dict[str, str] = {}
    wanted: set[str] = set()  # the sites the blocked jobs before this one wait for
    registry = jobs.registry
    for row in pending:
        try:
            job = job_from_row(row)
        except ConfigError:
            return row, blocked  # its run fails it with the reason, and the queue goes on
        usable = [n for n in registry.all() if registry.is_alive(n) and
                  eligibility(job, n, True, row.bundle, jobs.studies) is None]
        holders = {n.name: jobs.seats.busy_with(row.job_id, n) for n in usable}
        free = {name for name, holder in holders.items() if holder is None}
        need = job.min_available_nodes or job.min_nodes
        if len(free) >= need and not free & wanted:
            return row, blocked
        if len(usable) >= need or free & wanted:
            busy = sorted({j for h in holders.values() if h is not None
                           for j in h.split(", ")})
            of = f" of study {job.study}" if job.study else ""
            why = f"needs {need} sites{of}"
            if busy:
                why += (f"; {len(usable) - len(free)} busy with job "
                        f"{', '.join(busy)} ({_slots_held(usable, holders)})")
            if free & wanted:
                why += "; waits behind an earlier job that needs the same sites"
            blocked[row.job_id] = why
            wanted |= set(holders)
            continue
        return row, blocked
    return None, blocked


def _slots_held(usable: list[Node], holders: dict[str, str | None]) -> str:
    """'site-a: 1 of 1 slot; site-b: 2 of 2 slots': the busy sites' slots (the first few)."""
    busy = [n for n in usable if holders.get(n.name) is not None]
    shown = [f"{n.name}: {n.slots} of {n.slots} slot{'s' if n.slots > 1 else ''}"
             for n in busy[:MAX_SITES_NAMED]]
    more = len(busy) - len(shown)
    return "; ".join(shown) + (f"; {more} more" if more > 0 else "")
