"""How an attempt ends: awaited until its deadline, or sooner when no answer can still help
(every awaited node gone, or too many ineligible); then closed: a task still out is dropped
(unless the plan lets it join a later step) and its node lets go of it."""

from __future__ import annotations

import asyncio
import logging
import time

from fedgpu.server.registry import Registry
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.plans import Plan
from fedgpu.server.rounds.states import SlotState

# The engine's logger: these lines were always the round engine's own.
log = logging.getLogger("fedgpu.server.rounds.engine")


async def await_answers(rnd: RoundState, plan: Plan, registry: Registry) -> None:
    while not rnd.done.is_set():
        now = time.time()
        if now >= rnd.deadline or rnd.hopeless() or plan.stop_waiting(rnd, registry, now):
            break
        # Wake regularly: a participant that vanished can't answer, but may be replaced.
        try:
            await asyncio.wait_for(rnd.done.wait(), timeout=min(rnd.deadline - now, 1.0))
        except TimeoutError:
            pass


def close(rnd: RoundState, plan: Plan, registry: Registry, job_id: str) -> None:
    """Close the attempt: no update is taken for it from here on."""
    rnd.closed = True
    for node_id, state in rnd.slots.items():
        node = registry.get(node_id)
        if state in (SlotState.ASSIGNED, SlotState.UPLOADING) and plan.carries(rnd, node_id):
            continue  # async: still training (or sending), its update joins a later step
        if state in (SlotState.ASSIGNED, SlotState.UPLOADING):
            rnd.slots[node_id] = SlotState.DROPPED
            log.info("round %d: %s dropped (no update by the deadline)", rnd.number, node_id)
        held = node.assigned.get(job_id) if node is not None else None
        if node is not None and held is not None and held.round == rnd.number:
            del node.assigned[job_id]
