"""Waiting for a round's pool: the connected sites that can take the job, less those whose
links cannot make the deadline; a job that never gets enough of them before its first round
fails after queue_timeout_s with the reason each site was left out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from fedgpu.core.bundles import BundleRef
from fedgpu.core.job import Job
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.attempt import RunFailed
from fedgpu.server.rounds.eligibility import Seating, eligible_nodes, never_started
from fedgpu.server.rounds.link_admission import LinkAdmission
from fedgpu.server.rounds.plans import Plan

# The engine's logger: these lines were always the round engine's own.
log = logging.getLogger("fedgpu.server.rounds.engine")


class NodeWait:
    def __init__(self, job: Job, registry: Registry, bundle: BundleRef | None,
                 roster: Seating | None, links: LinkAdmission) -> None:
        self.job = job
        self.registry = registry
        self.bundle = bundle
        self.roster = roster
        self.links = links
        # A round was ever opened (queue_timeout_s applies only before the first).
        self.opened_any = False
        # True while a round waits for enough nodes that can take the job (`job status`).
        self.waiting = False

    def eligible(self) -> list[Node]:
        """The connected sites that can take the job now (server/rounds/eligibility.py)."""
        return eligible_nodes(self.job, self.registry.alive(), self.bundle, self.roster)

    async def pool(self, needed: int, plan: Plan | None,
                   model_size: Callable[[], int]) -> list[Node]:
        """At least `needed` sites that can take the round; `model_size` (the download's
        bytes) is asked only when the plan's links are admitted by rate."""
        last_log = 0.0
        since = time.monotonic()
        while True:
            alive = self.eligible()
            if plan is not None and self.links.applies(plan.kind, plan.sends_model):
                # Sites whose links cannot make the deadline are left out (or compress).
                alive = self.links.sort(alive, model_size())
            if len(alive) >= needed:
                self.waiting = False
                self.opened_any = True
                return alive
            self.waiting = True
            if not self.opened_any and time.monotonic() - since > self.job.queue_timeout_s:
                raise RunFailed(never_started(self.job, self.registry, self.bundle, needed,
                                              len(alive), self.roster))
            if time.monotonic() - last_log > 30:
                log.info("waiting for nodes: %d of %d needed are connected and can take the "
                         "job", len(alive), needed)
                last_log = time.monotonic()
            try:
                await asyncio.wait_for(self.registry.changed.wait(), timeout=1.0)
            except TimeoutError:
                pass
