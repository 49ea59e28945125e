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

import asyncio
import json
import logging
import re
import secrets
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.core import mixing
from fedgpu.proto import pb
from fedgpu.server.registry import Node
from fedgpu.server.rounds import Orchestrator, RoundState, RunFailed, Task
from fedgpu.server.strategies.base import Strategy

log = logging.getLogger("fedgpu.server.ring")

# After the first failure report the others stop within their exchange timeout; this much more
# covers the lost-rank check and the upload of their failure.
_FAILURE_GRACE_S = 15.0


class RingAverage(Strategy):
    """Uniform average of the copies plus the sum of their squared norms, accumulated as they
    arrive. D-PSGD's output is the plain mean: every copy counts the same, whatever its data.
    No optimiser state: the base's empty state and checkpoint hooks serve."""

    name = "ring"

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

    def add(self, tensors: Mapping[str, np.ndarray], num_examples: int) -> None:
        del num_examples
        for name, arr in tensors.items():
            x = np.asarray(arr, dtype=np.float64)
            if np.issubdtype(self._dtypes.get(name, x.dtype), np.floating):
                self._sq += float(np.vdot(x, x))
            acc = self._sum.get(name)
            if acc is None:
                self._sum[name] = x.copy()
            else:
                acc += x
        self._n += 1

    def finish(self) -> dict[str, np.ndarray]:
        n = max(self._n, 1)
        mean = {k: v / n for k, v in self._sum.items()}
        sq_mean = sum(float(np.vdot(v, v)) for k, v in mean.items()
                      if np.issubdtype(self._dtypes.get(k, v.dtype), np.floating))
        # Cancellation can leave a tiny negative where the copies agree exactly.
        self.consensus_distance = max(self._sq / n - sq_mean, 0.0)
        return {k: v.astype(self._dtypes.get(k, v.dtype)) for k, v in mean.items()}


def peer_host(peer: str) -> str:
    """The IP in a gRPC peer string ("ipv4:10.0.0.5:41000", "ipv6:[::1]:41000")."""
    m = re.match(r"ipv4:([^:]+):\d+$", peer) or re.match(r"ipv6:\[([^\]]+)\]:\d+$", peer)
    return m.group(1) if m else peer


def block_range(number: int, blocks: int, iterations: int) -> tuple[int, int]:
    """(first iteration, count) of block `number` (1-based): the iterations split evenly."""
    first = (number - 1) * iterations // blocks
    return first, number * iterations // blocks - first


class RingOrchestrator(Orchestrator):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.strategy = RingAverage()  # type: ignore[assignment]
        self.mixing = mixing.resolve(self.job.mixing, self.job.min_nodes)
        # The first block this process runs starts every copy from the model it sends (a fresh
        # run, or one resumed from a checkpoint); so does every block after a failure.
        self._restart = True

    async def _train_round(self, number: int) -> None:
        n = self.job.min_nodes
        first, count = block_range(number, self.job.rounds, self.job.iterations)
        error = ""
        for attempt in range(1, self.job.round_retries + 2):
            nodes = await self._wait_for_nodes(n)
            chosen = sorted(nodes, key=lambda x: x.name)[:n]
            rnd = self._open_block(number, attempt, chosen, first, count)
            assert self.global_weights is not None
            async with self._agg_lock:
                self.strategy.begin_round(self.global_weights)
            await self._await_block(rnd)
            restart = self._restart
            if rnd.accepted() >= n:
                async with self._agg_lock:
                    new = await asyncio.to_thread(self.strategy.finish)
                self._close_round(rnd)
                self._record(rnd)
                self._annotate(rnd, chosen, first, count, restart, None)
                self._restart = False
                await self._set_global(new, number)
                log.info("ring block %d (iterations %d..%d): consensus distance %.6g",
                         number, first, first + count - 1, self.strategy.consensus_distance)
                return
            self._close_round(rnd)
            error = self._block_error(rnd, chosen)
            self._record(rnd, status="retried")
            self._annotate(rnd, chosen, first, count, restart, error)
            self._restart = True
            log.warning("%s; attempt %d of %d%s", error, attempt, self.job.round_retries + 1,
                        ", restarting the block from the averaged model of block "
                        f"{self.global_round}" if attempt <= self.job.round_retries else "")
        raise RunFailed(
            f"{error}. The averaged model of block {self.global_round} is checkpointed: "
            "restart the aggregator with the same --state-dir to resume from it")

    def _open_block(self, number: int, attempt: int, chosen: list[Node], first: int,
                    count: int) -> RoundState:
        now = time.time()
        rnd = RoundState(number=number, kind=pb.TASK_KIND_TRAIN, attempt=attempt,
                         required=len(chosen), deadline=now + self.job.round_deadline_s,
                         started=now)
        master = chosen[0]
        if master.ring_port <= 0:
            raise RunFailed(f"node {master.name} (rank 0) announced no ring port; start it "
                            "with --ring-port")
        chunks, enc = self._payload_chunks()
        assignment = dict(
            run_id=self.run_id,
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
        for rank, node in enumerate(chosen):
            task_id = secrets.token_hex(8)
            header = pb.TaskHeader(
                task_id=task_id, round=number, kind=pb.TASK_KIND_TRAIN,
                task_name=self.job.task,
                hyperparameters_json=json.dumps(self.job.hyperparameters),
                use_gpu=self.job.use_gpu, payload_size=enc.size, payload_sha256=enc.sha256,
                evaluated_round=self.global_round,
                # The same every block: batch order is seeded by it, rank and epoch only.
                seed=self.job.seed,
                ring=pb.RingAssignment(rank=rank, **assignment),
            )
            node.pending = Task(task_id, number, pb.TASK_KIND_TRAIN, header, chunks)
            node.wakeup.set()
            rnd.status[node.node_id] = "assigned"
            rnd.task_ids[node.node_id] = task_id
        self.current = rnd
        log.info("ring block %d (attempt %d, iterations %d..%d%s): rendezvous %s:%d, ranks %s",
                 number, attempt, first, first + count - 1,
                 ", from the averaged model" if self._restart else "",
                 assignment["master_addr"], assignment["master_port"],
                 ", ".join(f"{r}={n.name}" for r, n in enumerate(chosen)))
        return rnd

    async def _await_block(self, rnd: RoundState) -> None:
        # One lost rank fails the whole block: no waiting for the deadline once the others
        # have had time to notice and report.
        failed_at: float | None = None
        while not rnd.done.is_set():
            now = time.time()
            if now >= rnd.deadline:
                break
            if failed_at is None and any(s in ("failed", "rejected")
                                         for s in rnd.status.values()):
                failed_at = now
            if failed_at is not None and now - failed_at > (self.job.ring_timeout_s
                                                            + _FAILURE_GRACE_S):
                break
            waiting = [self.registry.get(nid) for nid, s in rnd.status.items()
                       if s == "assigned"]
            if waiting and not any(n is not None and self.registry.is_alive(n)
                                   for n in waiting):
                break
            try:
                await asyncio.wait_for(rnd.done.wait(), timeout=1.0)
            except TimeoutError:
                pass

    def _block_error(self, rnd: RoundState, chosen: list[Node]) -> str:
        rank_of = {n.node_id: r for r, n in enumerate(chosen)}
        name = {n.node_id: n.name for n in chosen}
        # A worker that failed on its own, or a node that never answered, is the cause; the
        # others' "ring lost rank N" errors are the consequence, and they say whom they lost.
        own = {f["node_id"]: f["error"] for f in rnd.failures if "ring lost" not in f["error"]}
        dropped = [nid for nid, s in rnd.status.items() if s == "dropped"]
        causes = sorted({rank_of[nid] for nid in [*own, *dropped] if nid in rank_of})
        if not causes:
            named = {int(r) for f in rnd.failures for r in re.findall(r"rank (\d+) \(",
                                                                       f["error"].split(":")[0])}
            causes = sorted(r for r in named if r < len(chosen))
        lost = ", ".join(f"rank {r} ({chosen[r].name})" for r in causes) or "a rank"
        detail = "; ".join(
            f"{name.get(nid, nid)}: {own[nid]}" if nid in own else f"{name.get(nid, nid)}: no "
            "answer (node lost)" for nid in [*own, *dropped])
        others = sorted(f["node"] for f in rnd.failures if "ring lost" in f["error"])
        return (f"ring block {rnd.number} lost {lost}" + (f" ({detail})" if detail else "")
                + (f"; the other ranks stopped: {', '.join(others)}" if others else ""))

    def _annotate(self, rnd: RoundState, chosen: list[Node], first: int, count: int,
                  restart: bool, error: str | None) -> None:
        rec = self.history[-1]
        per_iteration = [u.get("iteration_loss") or [] for u in rnd.updates]
        per_iteration = [x for x in per_iteration if len(x) == count]
        sent = [u["train_metrics"].get("bytes_sent_per_iteration") for u in rnd.updates]
        sent = [s for s in sent if s is not None]
        nccl = [u["train_metrics"].get("nccl") for u in rnd.updates]
        rec["ring"] = {
            "first_iteration": first,
            "iterations": count,
            "local_steps": self.job.local_steps,
            "ranks": [n.name for n in chosen],
            "restart": restart,
            "backend": None if not nccl or None in nccl else ("nccl" if all(nccl) else "gloo"),
            "consensus_distance": None if error else self.strategy.consensus_distance,
            "bytes_sent_per_worker_per_iteration": (sum(sent) / len(sent)) if sent else None,
            "iteration_loss": [float(np.mean(col)) for col in zip(*per_iteration, strict=True)]
            if per_iteration else [],
            "error": error,
        }

    async def accept(self, node: Node, header: pb.UpdateHeader, rnd: RoundState,
                     tensors: dict[str, np.ndarray] | None, payload_bytes: int) -> None:
        await super().accept(node, header, rnd, tensors, payload_bytes)
        for update in rnd.updates:
            if update["node_id"] == node.node_id:
                update["iteration_loss"] = [round(v, 6) for v in header.iteration_loss]

    def checkpoint_state(self) -> dict[str, Any]:
        return {**super().checkpoint_state(), "mode": "ring"}
