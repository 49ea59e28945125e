"""The aggregator's log lines about a job, kept as that job's events (`fedgpu job logs`).

A logging handler on the `fedgpu.server` loggers: what the round engine already says (rounds
opened and closed, nodes dropped, updates refused, failures nodes reported) becomes the running
job's event list in the database, with no second set of calls to keep in step. A record
logged with `extra={"node": NAME}` is filed as the node's (the errors nodes reported).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fedgpu.server.jobs.log_context import CURRENT_JOB

if TYPE_CHECKING:
    from fedgpu.server.jobs.queue import JobManager

# The job manager writes its own events (submitted, started, ended) explicitly.
_OWN = "fedgpu.server.jobs.queue"


class JobLogHandler(logging.Handler):
    def __init__(self, jobs: JobManager) -> None:
        super().__init__(level=logging.INFO)
        self.jobs = jobs

    def emit(self, record: logging.LogRecord) -> None:
        running = self.jobs.running
        if not running or record.name.startswith(_OWN):
            return
        # Several jobs at once: a line goes to the job it names (`extra={"job_id": ...}`, or
        # logged by that job's engine: server/jobs/log_context.py); one that names none
        # stays in the aggregator's log only.
        job_id = (getattr(record, "job_id", None) or CURRENT_JOB.get()
                  or (next(iter(running)) if len(running) == 1 else None))
        if job_id not in running:
            return
        try:
            node = getattr(record, "node", None)
            self.jobs.store.add_event(
                job_id, record.getMessage(), level=record.levelname.lower(),
                source="node" if node else "aggregator", node=node)
        except Exception:  # noqa: BLE001 - a log line must never break the aggregator
            self.handleError(record)
