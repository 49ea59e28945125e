"""Which connected nodes can take a job, and why the others can't: one rule for the round
engine (which nodes it samples, server/rounds.py) and for the documents (`fedgpu job status`,
the reason a job waits, server/jobs.py).

The rule is a list of checks, each saying why a node cannot take the job or None; the first
reason found is the node's. A node that reports nothing a check needs (an older node,
`fedgpu sim`) passes that check: the node itself decides when the task comes, and says so.
"""

from __future__ import annotations

from collections.abc import Callable

from fedgpu.core import admission
from fedgpu.core.config import Job
from fedgpu.server.registry import Node

Check = Callable[[Job, Node], str | None]


def task_installed(job: Job, node: Node) -> str | None:
    if node.tasks and job.task not in node.tasks:
        shown = ", ".join(node.tasks[:8]) + (", ..." if len(node.tasks) > 8 else "")
        return f"task {job.task!r} is not installed there (installed: {shown})"
    return None


def gpu_fits(job: Job, node: Node) -> str | None:
    """The job's [resources] against the node's GPUs as its last heartbeat reported them (and
    its own answer to a task of this job, until it reports again)."""
    needs = job.needs
    if node.refusal is not None and node.refusal[0] == needs:
        return node.refusal[1]
    if node.capacity is None:
        return None
    return admission.refusal(needs, node.capacity)


CHECKS: tuple[Check, ...] = (task_installed, gpu_fits)


def eligibility(job: Job, node: Node, alive: bool) -> str | None:
    """Why `node` cannot take part in `job` now; None when it can."""
    if not alive:
        return "not connected (no heartbeat)"
    for check in CHECKS:
        reason = check(job, node)
        if reason is not None:
            return reason
    return None


def eligible_nodes(job: Job, nodes: list[Node]) -> list[Node]:
    """The nodes of `nodes` (alive ones) that can take part in `job`."""
    return [n for n in nodes if eligibility(job, n, True) is None]
