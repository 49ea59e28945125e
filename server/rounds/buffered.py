"""mode = "async": FedBuff (Nguyen et al. 2022) on the round engine. A "round" is one buffer
step: it opens a task on the latest model for every idle node and closes as soon as
`buffer_size` updates were accepted, whichever model version each was trained on. Nodes still
training stay in flight into the next steps (their tasks are not dropped at close), and their
update, when it comes, is weighted by its staleness (steps since its task) and refused with
the reason past `max_staleness`. Each step is checkpointed like a round, so the dashboard,
`fedgpu rounds` and resume work as in star mode; tasks in flight at a restart are forgotten
(their updates are refused, and the nodes get new tasks)."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from fedgpu.core.job import Job
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.plans import TrainPlan
from fedgpu.server.rounds.records import RoundRecord, UpdateRecord
from fedgpu.server.rounds.states import SlotState
from fedgpu.server.strategies.fedbuff import FedBuff
from fedgpu.server.strategies.hetero_math import staleness_refusal

log = logging.getLogger("fedgpu.server.rounds")


class AsyncPlan(TrainPlan):
    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.strategy = FedBuff(job.hetero.staleness_weighting)
        self.buffer = job.hetero.buffer_size
        self.bound = job.hetero.max_staleness
        # node id -> (task id, the step whose model it trains on), for tasks not yet answered.
        self.in_flight: dict[str, tuple[str, int]] = {}
        # Set when a step opens: updates that arrived between two steps wait for it.
        self.step_opened = asyncio.Event()

    def holds(self, task_id: str) -> bool:
        return any(tid == task_id for tid, _ in self.in_flight.values())

    def pool_size(self) -> int:
        return self.job.min_available_nodes or self.job.min_nodes

    def choose(self, pool: list[Node], number: int, attempt: int) -> list[Node]:
        # Every idle node trains on the latest model: nobody waits for the slowest.
        return [n for n in pool if n.node_id not in self.in_flight]

    def required(self, chosen: list[Node]) -> int:
        return self.buffer

    def opened(self, rnd: RoundState) -> None:
        fresh = {nid: (tid, rnd.number) for nid, tid in rnd.task_ids.items()}
        for nid, (tid, number) in list(self.in_flight.items()):
            if staleness_refusal(rnd.number - number, self.bound) is not None:
                log.info("step %d: the task given to %s at step %d is more than %d steps "
                         "old; its update will be refused", rnd.number, nid, number, self.bound)
                continue
            rnd.slots[nid] = SlotState.ASSIGNED
            rnd.task_ids[nid] = tid
            fresh[nid] = (tid, number)
        self.in_flight = fresh
        rnd.enough = self.buffer
        self.step_opened.set()
        self.step_opened = asyncio.Event()

    def answers(self, rnd: RoundState, header_round: int) -> bool:
        return header_round <= rnd.number

    def stale_reason(self, rnd: RoundState, header_round: int) -> str | None:
        if header_round > rnd.number:
            return None
        return staleness_refusal(rnd.number - header_round, self.bound)

    def carries(self, rnd: RoundState, node_id: str) -> bool:
        return node_id in self.in_flight

    def stop_waiting(self, rnd: RoundState, registry: Registry, now: float) -> bool:
        return rnd.accepted() >= self.buffer or super().stop_waiting(rnd, registry, now)

    def on_update(self, update: UpdateRecord, header: pb.UpdateHeader) -> None:
        task = self.in_flight.pop(update.node_id, None)
        if task is not None:
            assert self.run is not None
            update.extra["staleness"] = self.run.global_round + 1 - task[1]

    def closed(self, rnd: RoundState, record: RoundRecord | None, chosen: list[Node],
               ok: bool) -> str:
        # Only tasks still unanswered stay in flight (failed, refused and dropped ones end).
        self.in_flight = {nid: t for nid, t in self.in_flight.items()
                          if rnd.slots.get(nid) in (SlotState.ASSIGNED, SlotState.UPLOADING)}
        if record is not None:
            record.extra["in_flight"] = len(self.in_flight)
        return super().closed(rnd, record, chosen, ok)

    def describe(self, rnd: RoundState, chosen: list[Node]) -> str:
        return (f"step {rnd.number} (async, attempt {rnd.attempt}) opened for "
                f"{len(chosen)} idle node(s) on model {rnd.number - 1}, "
                f"{len(rnd.slots) - len(chosen)} still training; "
                f"a step every {self.buffer} update(s)")


class _Run(Protocol):
    current: RoundState | None
    current_plan: object


async def next_step(run: _Run, task_id: str, timeout: float) -> bool:
    """An update of an async job whose task is in flight, arriving while no step is open (the
    last one is being aggregated or checkpointed): wait for the next step instead of refusing
    it. True when a step is open now."""
    end = asyncio.get_running_loop().time() + timeout
    while run.current is None or run.current.closed:
        plan = run.current_plan
        if not isinstance(plan, AsyncPlan) or not plan.holds(task_id):
            return False
        left = end - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(plan.step_opened.wait(), max(left, 0.0))
        except TimeoutError:
            return False
    return True
