"""Which connected nodes can take a job, and why the others can't: one rule for the round
engine (which nodes it samples, server/rounds/engine.py) and for the documents (`fedgpu job status`,
the reason a job waits, server/jobs/queue.py).

The rule is a list of checks, each saying why a node cannot take the job or None; the first
reason found is the node's. A node that reports nothing a check needs (an older node,
`fedgpu sim`) passes that check: the node itself decides when the task comes, and says so.

A job whose task is installed needs it installed on the node. A job whose task came as a
bundle needs the node's site to allow that bundle: its `--task-approval` mode, and in mode
`approved` the site's answer about that very sha256, which the node gives in its heartbeats
(node/bundle_keeper.py). A node that has not allowed the bundle is never sampled, so a job
does not burn its round retries on sites that have not approved it yet: it waits.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Protocol

from fedgpu.core import admission
from fedgpu.core.bundles import BundleRef
from fedgpu.core.constants import BundleState, TaskApproval
from fedgpu.core.job import Job
from fedgpu.core.site_policy import REFUSAL_PREFIX, terms_of
from fedgpu.server.registry import LOOP_GRACE_S, Node, Registry

Check = Callable[[Job, Node, "BundleRef | None"], "str | None"]


class Roster(Protocol):
    """The aggregator's studies (server/studies.py): why a node is not sampled for a job of
    `study` (not enrolled, or its site does not serve it); None when it may be."""

    def refusal(self, study: str | None, node: Node) -> str | None: ...


class Seating(Roster, Protocol):
    """A running job's roster when several jobs run at once (server/jobs/seats.py): the
    sites a round samples are held by the job until it ends."""

    def claim(self, nodes: list[Node]) -> None: ...


def task_available(job: Job, node: Node, bundle: BundleRef | None) -> str | None:
    """Installed on the node, or (a bundle job) allowed by its site."""
    if bundle is not None:
        return bundle_refusal(bundle, node)
    if node.tasks and job.task not in node.tasks:
        shown = ", ".join(node.tasks[:8]) + (", ..." if len(node.tasks) > 8 else "")
        return f"task {job.task!r} is not installed there (installed: {shown})"
    return None


def gpu_fits(job: Job, node: Node, bundle: BundleRef | None) -> str | None:
    """The job's [resources] against the node's GPUs as its last heartbeat reported them (and
    its own answer to a task of this job, until it reports again)."""
    needs = job.needs
    if node.refusal is not None and node.refusal[0] == needs:
        return node.refusal[1]
    if node.capacity is None:
        return None
    return admission.refusal(needs, node.capacity)


def task_loop_polls(job: Job, node: Node, bundle: BundleRef | None) -> str | None:
    """Its task loop asks for work (server/registry.py): heartbeats alone do not make a node
    that can train (its worker loop may be stuck, or busy with another task). A node working
    on a task of the open round is busy by design: `job status` must not call it stuck."""
    if node.assigned:
        return None
    quiet = node.loop_quiet_s(time.time())
    if quiet > LOOP_GRACE_S:
        return (f"its task loop has not asked for work for {quiet:.0f} s (busy or stuck): "
                "sampled again once it polls")
    return None


def site_policy_allows(job: Job, node: Node, bundle: BundleRef | None) -> str | None:
    """The site's own policy as it advertised it (fedgpu/core/site_policy.py), its hours
    against the clock now: a site that would refuse is not sampled (its own check decides
    in the end; this spares the round an attempt and says why in `job status`)."""
    remembered = node.policy_refusal
    if remembered is not None and remembered[0] is job and time.time() < remembered[1]:
        return remembered[2]
    if node.site_policy is None:
        return None
    reasons = node.site_policy.refusals(
        terms_of(job, bundle_sha256=bundle.sha256 if bundle is not None else ""),
        dt.datetime.now(dt.UTC))
    return REFUSAL_PREFIX + "; ".join(reasons) if reasons else None


CHECKS: tuple[Check, ...] = (task_loop_polls, task_available, site_policy_allows, gpu_fits)


def lost_since(node: Node) -> str:
    """'lost since 12:03 UTC' (the day too when not today): how a job waiting for a site that
    stopped heartbeating, or has not come back after a restart, names it."""
    then, now = time.gmtime(node.last_seen), time.gmtime()
    shown = time.strftime("%H:%M" if then[:3] == now[:3] else "%Y-%m-%d %H:%M", then)
    return f"lost since {shown} UTC"


def eligibility(job: Job, node: Node, alive: bool, bundle: BundleRef | None = None,
                roster: Roster | None = None) -> str | None:
    """Why `node` cannot take part in `job` now; None when it can. A job of a study takes
    only that study's sites, and a site another running job holds is busy (`roster`), whatever
    else they could do: that reason comes first."""
    if roster is not None:
        outside = roster.refusal(job.study, node)
        if outside is not None:
            return outside
    if not alive:
        return lost_since(node)
    for check in CHECKS:
        reason = check(job, node, bundle)
        if reason is not None:
            return reason
    return None


def bundle_refusal(bundle: BundleRef, node: Node) -> str | None:
    mode = node.task_approval or TaskApproval.INSTALLED
    if mode == TaskApproval.INSTALLED:
        return (f"the site runs installed tasks only (--task-approval installed), and task "
                f"{bundle.name!r} came as bundle {bundle.sha256[:12]}; that site can bake it "
                "into its node image instead")
    state, reason = node.bundle_states.get(bundle.sha256, (None, ""))
    if state == BundleState.UNUSABLE:
        return f"bundle {bundle.sha256[:12]} cannot run there: {reason}"
    if mode == TaskApproval.ANY:
        return None
    if state == BundleState.APPROVED:
        return None
    if state == BundleState.REJECTED:
        return f"the site rejected bundle {bundle.sha256[:12]} ({bundle.name})"
    if state == BundleState.PENDING:
        return (f"waiting for the site to approve bundle {bundle.sha256} ({bundle.name}): "
                f"'fedgpu node approve {bundle.sha256}' there")
    return (f"the site has not answered about bundle {bundle.sha256[:12]} yet (its next "
            "heartbeat will)")


def eligible_nodes(job: Job, nodes: list[Node], bundle: BundleRef | None = None,
                   roster: Roster | None = None) -> list[Node]:
    """The nodes of `nodes` (alive ones) that can take part in `job`."""
    return [n for n in nodes if eligibility(job, n, True, bundle, roster) is None]


def never_started(job: Job, registry: Registry, bundle: BundleRef | None, needed: int,
                  able: int, roster: Roster | None = None) -> str:
    """Why a job gave up waiting for its first round (queue_timeout_s): the count and a few
    sites' own reasons."""
    reasons = []
    for node in registry.all()[:3]:
        why = eligibility(job, node, registry.is_alive(node), bundle, roster)
        if why is not None:
            reasons.append(f"{node.name}: {why}")
    more = f" ({'; '.join(reasons)})" if reasons else " (no node is registered)"
    return (f"the job never started: {needed} nodes that can take it were needed and {able} "
            f"could, for queue_timeout_s = {job.queue_timeout_s:g} s{more}")
