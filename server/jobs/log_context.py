"""Which job a log line is about, when several run at once: a context variable set for each
job's round engine (its asyncio task, and whatever that task starts: threads through
asyncio.to_thread and tasks copy it) and for a node's update while it is taken in. The job
log handler (server/jobs/events.py) files a line under the job it names, so `fedgpu job logs
JOB` shows that job's round lines and no other's, with no job id passed to every log call.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# The id of the job whose code logs now; "" outside any job's.
CURRENT_JOB: contextvars.ContextVar[str] = contextvars.ContextVar("fedgpu_job", default="")


def job_task(job_id: str, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """`coro` as a task whose log lines (and those of what it starts) name job `job_id`."""
    context = contextvars.copy_context()
    context.run(CURRENT_JOB.set, job_id)
    return asyncio.create_task(coro, name=name, context=context)


def about(job_id: str) -> None:
    """From here on in this task (a node's update being taken in), lines name `job_id`."""
    CURRENT_JOB.set(job_id)
