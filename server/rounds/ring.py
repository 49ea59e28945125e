"""Ring mode (D-PSGD) at the aggregator: coordination only, never the gossip itself.

The nodes average with their ring neighbours over torch.distributed; this side (no torch)
assigns ranks (the chosen nodes in name order, so a restarted run lines up with the copies the
nodes kept), names the rendezvous (rank 0's announced ring host and port), hands each node its
block of iterations, and watches. A round of the run is a block of iterations: at its end every
worker pushes its own copy, and the copies are folded in as they stream (memory O(model)) into
the average — the algorithm's output, checkpointed per block — and into the consensus distance
mean_i ||x_i - mean x||^2 = mean_i ||x_i||^2 - ||mean x||^2. The next block sends the average
back for federated evaluation, exactly as star mode evaluates its global model.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.core import mixing
from fedgpu.core.job import Job
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.attempt import RoundState, RunFailed
from fedgpu.server.rounds.plans import TrainPlan
from fedgpu.server.rounds.records import RingInfo, RoundRecord, UpdateRecord
from fedgpu.server.rounds.states import SlotState
from fedgpu.server.strategies.base import Strategy
from fedgpu.server.strategies.update import UpdateIn

log = logging.getLogger("fedgpu.server.rounds.ring")

# After the first failure report the others stop within their exchange timeout; this much more
# covers the lost-rank check and the upload of their failure.
_FAILURE_GRACE_S = 15.0


class RingAverage(Strategy):
    """Uniform average of the copies plus the sum of their squared norms, accumulated as they
    arrive. D-PSGD's output is the plain mean: every copy counts the same, whatever its data.
    No optimiser state: the base's empty state and checkpoint hooks serve."""

    name = "ring"  # the strategy table's internal row (mode = "ring")

    def __init__(self) -> None:
        super().__init__()
        self._sum: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._sq = 0.0
        self._n = 0
        self.consensus_distance: float | None = None

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        self._dtypes = {k: v.dtype for k, v in global_weights.items()}
        self._sum = {}
        self._sq, self._n = 0.0, 0

    def add(self, update: UpdateIn) -> None:
        n = self._n + 1
        for name, arr in update.tensors.items():
            x = np.asarray(arr, dtype=np.float64)
            if np.issubdtype(self._dtypes.get(name, x.dtype), np.floating):
                self._sq += float(np.vdot(x, x))
            acc = self._sum.get(name)
            if acc is None:
                self._sum[name] = x.copy()
            else:
                # A running mean, not a sum: no finite copies can overflow it.
                acc *= (n - 1) / n
                acc += x / n
        self._n = n

    def finish(self) -> dict[str, np.ndarray]:
        n = max(self._n, 1)
        mean = self._sum
        sq_mean = sum(float(np.vdot(v, v)) for k, v in mean.items()
                      if np.issubdtype(self._dtypes.get(k, v.dtype), np.floating))
        # Cancellation can leave a tiny negative where the copies agree exactly.
        distance = max(self._sq / n - sq_mean, 0.0)
        self.consensus_distance = distance if math.isfinite(distance) else None
        return {k: v.astype(self._dtypes.get(k, v.dtype)) for k, v in mean.items()}


def peer_host(peer: str) -> str:
    """The IP in a gRPC peer string ("ipv4:10.0.0.5:41000", "ipv6:[::1]:41000")."""
    m = re.match(r"ipv4:([^:]+):\d+$", peer) or re.match(r"ipv6:\[([^\]]+)\]:\d+$", peer)
    return m.group(1) if m else peer


def block_range(number: int, blocks: int, iterations: int) -> tuple[int, int]:
    """(first iteration, count) of block `number` (1-based): the iterations split evenly."""
    first = (number - 1) * iterations // blocks
    return first, number * iterations // blocks - first


class RingPlan(TrainPlan):
    """A round of the run is a block of iterations on a ring of the first `min_nodes` nodes by
    name; one lost rank fails the whole block, which restarts from the averaged model."""

    strategy: RingAverage

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.strategy = RingAverage()
        self.mixing = mixing.resolve(job.mixing, job.min_nodes)
        # The first block this process runs starts every copy from the model it sends (a fresh
        # run, or one resumed from a checkpoint); so does every block after a failure.
        self._restart = True
        self._opened: dict[str, Any] = {}

    def pool_size(self) -> int:
        return self.job.min_nodes

    def choose(self, pool: list[Node], number: int, attempt: int) -> list[Node]:
        return sorted(pool, key=lambda x: x.name)[: self.job.min_nodes]

    def task_fields(self, number: int, attempt: int, chosen: list[Node]
                    ) -> list[dict[str, Any]]:
        assert self.run is not None, "bind the plan to its run first"
        master = chosen[0]
        if master.ring_port <= 0:
            raise RunFailed(f"node {master.name} (rank 0) announced no ring port; start it "
                            "with --ring-port")
        first, count = block_range(number, self.job.rounds, self.job.iterations)
        assignment = dict(
            run_id=self.run.run_id,
            world_size=len(chosen),
            master_addr=master.ring_host or peer_host(master.peer),
            master_port=master.ring_port,
            first_iteration=first,
            iterations=count,
            total_iterations=self.job.iterations,
            local_steps=self.job.local_steps,
            mixing=[float(v) for v in self.mixing.reshape(-1)],
            peers=[n.name for n in chosen],
            restart=self._restart,
            timeout_s=self.job.ring_timeout_s,
        )
        self._opened = assignment
        # The seed is the same every block: batch order is seeded by it, rank and epoch only.
        return [{"seed": self.job.seed, "ring": pb.RingAssignment(rank=rank, **assignment)}
                for rank in range(len(chosen))]

    def describe(self, rnd: RoundState, chosen: list[Node]) -> str:
        a = self._opened
        first, count = a["first_iteration"], a["iterations"]
        return (f"ring block {rnd.number} (attempt {rnd.attempt}, iterations {first}.."
                f"{first + count - 1}{', from the averaged model' if a['restart'] else ''}): "
                f"rendezvous {a['master_addr']}:{a['master_port']}, ranks "
                + ", ".join(f"{r}={n.name}" for r, n in enumerate(chosen)))

    def stop_waiting(self, rnd: RoundState, registry: Registry, now: float) -> bool:
        # One lost rank fails the whole block: no waiting for the deadline once the others
        # have had time to notice and report.
        if rnd.first_failure_at is not None and now - rnd.first_failure_at > (
                self.job.ring_timeout_s + _FAILURE_GRACE_S):
            return True
        waiting = [registry.get(nid) for nid in rnd.waiting_on()]
        return bool(waiting) and not any(n is not None and registry.is_alive(n)
                                         for n in waiting)

    def series_length(self) -> int:
        return int(self._opened.get("iterations", 0))

    def on_update(self, update: UpdateRecord, header: pb.UpdateHeader) -> None:
        update.iteration_loss = [round(v, 6) for v in header.iteration_loss]

    def closed(self, rnd: RoundState, record: RoundRecord | None, chosen: list[Node],
               ok: bool) -> str:
        assert record is not None and self.run is not None
        a = self._opened
        first, count = a["first_iteration"], a["iterations"]
        error = None if ok else (rnd.error or block_error(rnd, chosen))
        record.ring = _ring_info(rnd, chosen, first, count, self.job.local_steps, a["restart"],
                                 self.strategy.consensus_distance if ok else None, error)
        if ok:
            self._restart = False
            distance = self.strategy.consensus_distance
            log.info("ring block %d (iterations %d..%d): consensus distance %s", rnd.number,
                     first, first + count - 1, "n/a" if distance is None else f"{distance:.6g}")
            return ""
        self._restart = True
        assert error is not None
        log.warning("%s; attempt %d of %d%s", error, rnd.attempt, self.attempts(),
                    ", restarting the block from the averaged model of block "
                    f"{self.run.global_round}" if rnd.attempt < self.attempts() else "")
        return error

    def give_up(self, number: int, error: str) -> str:
        assert self.run is not None
        return (f"{error}. The averaged model of block {self.run.global_round} is checkpointed: "
                "restart the aggregator with the same --state-dir to resume from it")

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"mode": "ring"}


def block_error(rnd: RoundState, chosen: list[Node]) -> str:
    """Which rank the block lost, and what each node said.

    A worker that failed on its own, or a node that never answered, is the cause; the others
    stopped because of it, and their updates name the ranks they lost (`lost_ranks`).
    """
    rank_of = {n.node_id: r for r, n in enumerate(chosen)}
    name = {n.node_id: n.name for n in chosen}
    own = {f.node_id: f.error for f in rnd.failures if not rnd.lost_ranks.get(f.node_id)}
    own.update({i.node_id: f"cannot take the job now: {i.reason}" for i in rnd.ineligible})
    dropped = rnd.in_state(SlotState.DROPPED)
    causes = sorted({rank_of[nid] for nid in [*own, *dropped] if nid in rank_of})
    if not causes:
        named = {r for ranks in rnd.lost_ranks.values() for r in ranks}
        causes = sorted(r for r in named if 0 <= r < len(chosen))
    lost = ", ".join(f"rank {r} ({chosen[r].name})" for r in causes) or "a rank"
    detail = "; ".join(
        f"{name.get(nid, nid)}: {own[nid]}" if nid in own else f"{name.get(nid, nid)}: no "
        "answer (node lost)" for nid in [*own, *dropped])
    others = sorted(f.node for f in rnd.failures if rnd.lost_ranks.get(f.node_id))
    return (f"ring block {rnd.number} lost {lost}" + (f" ({detail})" if detail else "")
            + (f"; the other ranks stopped: {', '.join(others)}" if others else ""))


def _ring_info(rnd: RoundState, chosen: list[Node], first: int, count: int, local_steps: int,
               restart: bool, distance: float | None, error: str | None) -> RingInfo:
    per_iteration = [u.iteration_loss or [] for u in rnd.updates]
    per_iteration = [x for x in per_iteration if len(x) == count]
    sent = [u.train_metrics.get("bytes_sent_per_iteration") for u in rnd.updates]
    sent = [s for s in sent if s is not None]
    nccl = [u.train_metrics.get("nccl") for u in rnd.updates]
    return RingInfo(
        first_iteration=first,
        iterations=count,
        local_steps=local_steps,
        ranks=[n.name for n in chosen],
        restart=restart,
        backend=None if not nccl or None in nccl else ("nccl" if all(nccl) else "gloo"),
        consensus_distance=distance,
        bytes_sent_per_worker_per_iteration=(sum(sent) / len(sent)) if sent else None,
        iteration_loss=[float(np.mean(col)) for col in zip(*per_iteration, strict=True)]
        if per_iteration else [],
        error=error,
    )
