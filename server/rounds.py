"""Round orchestration: sample nodes, hand out tasks, collect updates, close at the deadline."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import secrets
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedgpu.core import codec
from fedgpu.core.config import Job
from fedgpu.proto import pb
from fedgpu.server.aggregate import weighted_metric
from fedgpu.server.checkpoint import Checkpointer
from fedgpu.server.registry import Node, Registry
from fedgpu.server.strategies import make_strategy
from fedgpu.server.validation import UpdateRejected

log = logging.getLogger("fedgpu.server.rounds")

KIND_NAMES = {
    pb.TASK_KIND_INIT: "init",
    pb.TASK_KIND_TRAIN: "train",
    pb.TASK_KIND_EVALUATE: "evaluate",
}


@dataclass
class Task:
    task_id: str
    round: int
    kind: int
    header: pb.TaskHeader
    chunks: list[bytes]


@dataclass
class RoundState:
    number: int
    kind: int
    attempt: int
    required: int
    deadline: float
    started: float
    # node_id -> assigned | accepted | failed | rejected | dropped
    status: dict[str, str] = field(default_factory=dict)
    task_ids: dict[str, str] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    updates: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    bytes_received: int = 0
    # Seconds the strategy spent on this round (streaming adds + finish), and each node's
    # upload time as the aggregator saw it: `fedgpu report` splits a round's duration by them.
    aggregation_s: float = 0.0
    upload_s: dict[str, float] = field(default_factory=dict)

    def accepted(self) -> int:
        return sum(1 for s in self.status.values() if s == "accepted")

    def outstanding(self) -> int:
        return sum(1 for s in self.status.values() if s == "assigned")


class RunFailed(Exception):
    pass


class Orchestrator:
    def __init__(
        self,
        job: Job,
        registry: Registry,
        chunk_size: int = codec.DEFAULT_CHUNK_SIZE,
        checkpointer: Checkpointer | None = None,
        initial_weights: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.job = job
        self.registry = registry
        self.chunk_size = chunk_size
        self.checkpointer = checkpointer
        self.strategy = make_strategy(job.strategy, job.strategy_params)
        self.run_id = secrets.token_hex(6)
        self.state = "waiting"
        self.error: str | None = None
        self.started_at = time.time()
        self.finished_at: float | None = None
        self.global_weights: dict[str, np.ndarray] | None = (
            dict(initial_weights) if initial_weights is not None else None
        )
        self.global_spec: dict[str, tuple[str, tuple[int, ...]]] | None = (
            codec.spec(self.global_weights) if self.global_weights is not None else None
        )
        self.global_round = 0
        self.history: list[dict[str, Any]] = []
        self.initial_eval: dict[str, Any] | None = None
        self.current: RoundState | None = None
        self.rejections: Counter[str] = Counter()
        self.finished = asyncio.Event()
        self._agg_lock = asyncio.Lock()
        self._payload: tuple[list[bytes], codec.Encoded] | None = None
        # True once the job has run to its end, here or before a restart (from the checkpoint).
        self.completed = False

    def restore(self, weights: dict[str, np.ndarray], state: Mapping[str, Any]) -> None:
        """Continue a checkpointed run: the next round is the one after the last finished one
        (a round the restart interrupted runs again; none that finished runs twice)."""
        self.run_id = str(state["run_id"])
        self.global_weights = weights
        self.global_spec = codec.spec(weights)
        self.global_round = int(state["global_round"])
        self.history = list(state.get("history") or [])
        self.initial_eval = state.get("initial_eval")
        self.rejections = Counter(state.get("rejections") or {})
        self.started_at = float(state.get("started_at") or self.started_at)
        self.completed = bool(state.get("completed"))
        # Optimiser arrays (FedAdam moments...) live beside the checkpoint, not in state.json.
        tensors = (self.checkpointer.load_strategy_tensors(self.global_round)
                   if self.checkpointer is not None else None)
        self.strategy.load_state(state.get("strategy") or {}, tensors)
        self._payload = None
        log.info("resumed run %s after round %d of %d%s", self.run_id, self.global_round,
                 self.job.rounds, " (already complete)" if self.completed else "")

    # ---- the run ---------------------------------------------------------------------

    async def run(self) -> None:
        try:
            if self.global_weights is None:
                await self._initialise()
            if self.global_round == 0:
                # The starting model is checkpointed too: a node drew it at random, and a run
                # resumed before round 1 finishes must train from the very same weights.
                await self._set_global(self.global_weights, 0)
            self.state = "running"
            if not self.completed:
                for number in range(self.global_round + 1, self.job.rounds + 1):
                    await self._train_round(number)
                if self.job.evaluate:
                    await self._final_evaluation()
                self.completed = True
                # Once more with the final evaluation and `completed`, so a restart after the
                # end serves the finished run instead of evaluating again.
                await self._set_global(self.global_weights, self.global_round)
            self.state = "finished"
            log.info("run %s finished: %d rounds", self.run_id, self.job.rounds)
        except RunFailed as exc:
            self.state = "failed"
            self.error = str(exc)
            log.error("run failed: %s", exc)
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        finally:
            self.finished_at = time.time()
            self.current = None
            for node in self.registry.all():
                node.wakeup.set()
            self.finished.set()

    async def _wait_for_nodes(self, needed: int) -> list[Node]:
        last_log = 0.0
        while True:
            alive = [n for n in self.registry.alive() if self.job.task in n.tasks or not n.tasks]
            if len(alive) >= needed:
                return alive
            if time.monotonic() - last_log > 30:
                log.info("waiting for nodes: %d of %d needed are connected", len(alive), needed)
                last_log = time.monotonic()
            try:
                await asyncio.wait_for(self.registry.changed.wait(), timeout=1.0)
            except TimeoutError:
                pass

    async def _initialise(self) -> None:
        """Ask one node for the task's initial weights: the aggregator never runs torch."""
        for attempt in range(1, self.job.round_retries + 2):
            nodes = await self._wait_for_nodes(max(1, self.job.min_nodes))
            chosen = [nodes[(attempt - 1) % len(nodes)]]
            rnd = self._open_round(0, pb.TASK_KIND_INIT, attempt, chosen, required=1)
            await self._await_round(rnd)
            if rnd.accepted() >= 1 and self.global_weights is not None:
                self._close_round(rnd)
                log.info("initial model from %s: %d tensors", chosen[0].name,
                         len(self.global_weights))
                return
            self._close_round(rnd)
            log.warning("initialisation attempt %d got no model; retrying", attempt)
        raise RunFailed("no node returned initial weights; check the nodes' logs")

    async def _train_round(self, number: int) -> None:
        for attempt in range(1, self.job.round_retries + 2):
            nodes = await self._wait_for_nodes(self.job.min_available_nodes or self.job.min_nodes)
            chosen = self._sample(nodes, number, attempt)
            rnd = self._open_round(number, pb.TASK_KIND_TRAIN, attempt, chosen,
                                   required=self.job.min_nodes)
            assert self.global_weights is not None
            async with self._agg_lock:
                self.strategy.begin_round(self.global_weights)
            await self._await_round(rnd)
            if rnd.accepted() >= rnd.required:
                async with self._agg_lock:
                    t0 = time.perf_counter()
                    new = await asyncio.to_thread(self.strategy.finish)
                    rnd.aggregation_s += time.perf_counter() - t0
                self._close_round(rnd)
                # Recorded before the checkpoint is written, so the round is in its history.
                self._record(rnd)
                await self._set_global(new, number)
                return
            self._close_round(rnd)
            self._record(rnd, status="retried")
            log.warning(
                "round %d attempt %d closed with %d of %d required updates; retrying",
                number, attempt, rnd.accepted(), rnd.required,
            )
        raise RunFailed(
            f"round {number} did not get {self.job.min_nodes} updates in "
            f"{self.job.round_retries + 1} attempts"
        )

    async def _final_evaluation(self) -> None:
        nodes = await self._wait_for_nodes(1)
        rnd = self._open_round(self.job.rounds + 1, pb.TASK_KIND_EVALUATE, 1, nodes, required=1)
        await self._await_round(rnd)
        self._close_round(rnd)

    def _sample(self, nodes: list[Node], number: int, attempt: int) -> list[Node]:
        # Rounded first: 0.07 * 100 is 7.000000000000001 in binary floating point, not 8 nodes.
        k = max(self.job.min_nodes, math.ceil(round(self.job.fraction * len(nodes), 9)))
        k = min(k, len(nodes))
        # Seeded by job seed, round and attempt: the same pool gives the same sample.
        rng = random.Random(f"{self.job.seed}:{number}:{attempt}")
        ordered = sorted(nodes, key=lambda n: n.name)
        return sorted(rng.sample(ordered, k), key=lambda n: n.name)

    def _payload_chunks(self) -> tuple[list[bytes], codec.Encoded]:
        # Encoded once per global model and shared by every node's stream.
        if self._payload is None:
            assert self.global_weights is not None
            enc = codec.encode(self.global_weights, {"round": str(self.global_round)})
            self._payload = (list(codec.iter_chunks(enc, self.chunk_size)), enc)
        return self._payload

    def _open_round(
        self, number: int, kind: int, attempt: int, nodes: list[Node], required: int
    ) -> RoundState:
        now = time.time()
        rnd = RoundState(
            number=number,
            kind=kind,
            attempt=attempt,
            required=required,
            deadline=now + self.job.round_deadline_s,
            started=now,
        )
        chunks: list[bytes] = []
        size, digest = 0, ""
        if kind != pb.TASK_KIND_INIT:
            chunks, enc = self._payload_chunks()
            size, digest = enc.size, enc.sha256
        for node in nodes:
            task_id = secrets.token_hex(8)
            header = pb.TaskHeader(
                task_id=task_id,
                round=number,
                kind=kind,
                task_name=self.job.task,
                hyperparameters_json=json.dumps(self.job.hyperparameters),
                use_gpu=self.job.use_gpu,
                payload_size=size,
                payload_sha256=digest,
                evaluated_round=self.global_round,
                seed=self.job.seed * 1_000_003 + number * 1009 + attempt,
            )
            node.pending = Task(task_id, number, kind, header, chunks)
            node.wakeup.set()
            rnd.status[node.node_id] = "assigned"
            rnd.task_ids[node.node_id] = task_id
        self.current = rnd
        log.info(
            "round %d (%s, attempt %d) opened for %d node(s): %s",
            number, KIND_NAMES[kind], attempt, len(nodes), ", ".join(n.name for n in nodes),
        )
        return rnd

    async def _await_round(self, rnd: RoundState) -> None:
        while not rnd.done.is_set():
            remaining = rnd.deadline - time.time()
            if remaining <= 0:
                break
            # Wake regularly: a participant that vanished can't answer, but may be replaced.
            try:
                await asyncio.wait_for(rnd.done.wait(), timeout=min(remaining, 1.0))
            except TimeoutError:
                pass
            if rnd.outstanding() and all(
                self.registry.get(nid) is None
                for nid, s in rnd.status.items() if s == "assigned"
            ):
                break

    def _close_round(self, rnd: RoundState) -> None:
        rnd.closed = True
        for node_id, status in rnd.status.items():
            node = self.registry.get(node_id)
            if status == "assigned":
                rnd.status[node_id] = "dropped"
                log.info("round %d: %s dropped (no update by the deadline)", rnd.number, node_id)
            if node is not None and node.pending is not None and node.pending.round == rnd.number:
                node.pending = None
        self.current = None

    async def _set_global(self, weights: dict[str, np.ndarray], number: int) -> None:
        self.global_weights = weights
        self.global_round = number
        self._payload = None
        if self.checkpointer is not None:
            # The write (encode, fsync: seconds for a multi-GB model) runs in a thread so
            # heartbeats and long polls go on. The state is copied here, on the loop, because
            # late evaluations keep landing in the history meanwhile; the weights and the
            # optimiser arrays change only in the next round's finish, after this returns.
            state = json.loads(json.dumps(self.checkpoint_state()))
            await asyncio.to_thread(self.checkpointer.save, weights, state,
                                    tensors=self.strategy.tensor_state())

    def _record(self, rnd: RoundState, status: str = "finished") -> None:
        train_loss = weighted_metric(
            [(u["train_metrics"]["loss"], u["num_examples"]) for u in rnd.updates
             if "loss" in u["train_metrics"]]
        )
        self.history.append(
            {
                "round": rnd.number,
                "attempt": rnd.attempt,
                "status": status,
                "started_at": rnd.started,
                "duration_s": round(time.time() - rnd.started, 3),
                "participants": sorted(rnd.status),
                "nodes_reporting": rnd.accepted(),
                "dropped": sorted(n for n, s in rnd.status.items() if s == "dropped"),
                "train_loss": train_loss,
                "num_examples": sum(u["num_examples"] for u in rnd.updates),
                "bytes_received": rnd.bytes_received,
                "aggregation_s": round(rnd.aggregation_s, 4),
                "updates": rnd.updates,
                "rejected": rnd.rejected,
                "failures": rnd.failures,
                "eval": None,
            }
        )

    # ---- called by the gRPC service --------------------------------------------------

    def task_for(self, node: Node) -> Task | None:
        task = node.pending
        if task is None or self.current is None or task.round != self.current.number:
            return None
        return task

    def check_update(self, node: Node, header: pb.UpdateHeader) -> RoundState:
        rnd = self.current
        if rnd is None or rnd.number != header.round:
            if any(h["round"] == header.round for h in self.history):
                raise UpdateRejected(
                    "late", f"round {header.round} already closed: the update arrived after "
                    "its deadline and was dropped"
                )
            raise UpdateRejected(
                "stale_round", f"round {header.round} is not the current round "
                f"({rnd.number if rnd else 'none open'})"
            )
        status = rnd.status.get(node.node_id)
        if status is None:
            raise UpdateRejected("not_selected", f"node {node.name} was not selected for round "
                                 f"{rnd.number}")
        if rnd.task_ids.get(node.node_id) != header.task_id:
            raise UpdateRejected("wrong_task", f"task id {header.task_id!r} was not given to "
                                 f"{node.name} in round {rnd.number}")
        if status != "assigned":
            raise UpdateRejected("duplicate", f"{node.name} already sent its update for round "
                                 f"{rnd.number} ({status})")
        if header.kind != rnd.kind:
            raise UpdateRejected("wrong_kind", "update kind does not match the task")
        if header.kind == pb.TASK_KIND_TRAIN and not header.failed:
            if header.num_examples <= 0:
                raise UpdateRejected("num_examples", "num_examples must be positive")
        return rnd

    def reject(self, node: Node | None, header: pb.UpdateHeader | None, exc: UpdateRejected,
               rnd: RoundState | None = None) -> None:
        self.rejections[exc.reason] += 1
        entry = {
            "node_id": node.node_id if node else None,
            "node": node.name if node else None,
            "round": header.round if header else None,
            "reason": exc.reason,
            "message": exc.message,
        }
        # A rejected answer to the node's own open task ends its part in this round.
        rnd = rnd or self.current
        if (rnd is not None and not rnd.closed and node is not None and header is not None
                and rnd.task_ids.get(node.node_id) == header.task_id
                and rnd.number == header.round):
            rnd.rejected.append(entry)
            if rnd.status.get(node.node_id) == "assigned":
                rnd.status[node.node_id] = "rejected"
                node.pending = None
                self._maybe_done(rnd)
        elif header is not None:
            # Not an answer to an open task (late, stale, forged): still listed under the round
            # it names, so `fedgpu rounds --json` shows every refusal, not just a counter.
            target = (rnd.rejected if rnd is not None and not rnd.closed
                      and rnd.number == header.round else next(
                          (h["rejected"] for h in reversed(self.history)
                           if h["round"] == header.round), None))
            if target is not None:
                target.append(entry)
        log.warning("rejected update from %s: %s", entry["node"] or "an unknown node",
                    exc.message)

    def record_failure(self, node: Node, header: pb.UpdateHeader, rnd: RoundState) -> None:
        rnd.status[node.node_id] = "failed"
        rnd.failures.append({"node_id": node.node_id, "node": node.name, "error": header.error})
        node.rounds_failed += 1
        node.last_error = header.error
        node.pending = None
        log.warning("round %d: %s failed: %s", rnd.number, node.name, header.error)
        self._maybe_done(rnd)

    async def accept(
        self, node: Node, header: pb.UpdateHeader, rnd: RoundState,
        tensors: dict[str, np.ndarray] | None, payload_bytes: int,
    ) -> None:
        if rnd.status.get(node.node_id) == "accepted":
            # Two streams for one task raced through check_update; the first one won.
            raise UpdateRejected("duplicate", f"{node.name} already sent its update for round "
                                 f"{rnd.number} (accepted)")
        if rnd.closed or rnd.status.get(node.node_id) != "assigned":
            raise UpdateRejected("late", f"round {rnd.number} closed while the update streamed")
        if header.kind == pb.TASK_KIND_INIT:
            assert tensors is not None
            self.global_weights = {k: np.array(v) for k, v in tensors.items()}
            self.global_spec = codec.spec(self.global_weights)
            self._payload = None
        elif header.kind == pb.TASK_KIND_TRAIN:
            assert tensors is not None
            async with self._agg_lock:
                if rnd.closed:
                    raise UpdateRejected("late", f"round {rnd.number} closed before aggregation")
                t0 = time.perf_counter()
                await asyncio.to_thread(self.strategy.add, tensors, header.num_examples)
                rnd.aggregation_s += time.perf_counter() - t0
        rnd.status[node.node_id] = "accepted"
        rnd.bytes_received += payload_bytes
        resources = _resources(header.resources)
        update = {
            "node_id": node.node_id,
            "node": node.name,
            "num_examples": header.num_examples,
            "train_metrics": dict(header.train_metrics),
            "eval_metrics": dict(header.eval_metrics),
            "num_eval_examples": header.num_eval_examples,
            "resources": resources,
            "upload_s": rnd.upload_s.get(node.node_id),
            "gpu_decision": node.decision,
        }
        rnd.updates.append(update)
        node.pending = None
        node.last_round = rnd.number
        node.last_resources = resources
        if header.kind == pb.TASK_KIND_TRAIN:
            node.rounds_completed += 1
        if header.eval_metrics:
            self._attach_eval(header.evaluated_round, node, header)
        self._maybe_done(rnd)

    def _attach_eval(self, evaluated_round: int, node: Node, header: pb.UpdateHeader) -> None:
        entry = {
            "node_id": node.node_id,
            "node": node.name,
            "num_examples": header.num_eval_examples,
            "metrics": dict(header.eval_metrics),
        }
        if evaluated_round <= 0:
            target = self.initial_eval = self.initial_eval or {"per_node": []}
        else:
            rec = next((h for h in reversed(self.history)
                        if h["round"] == evaluated_round and h["status"] == "finished"), None)
            if rec is None:
                return
            target = rec["eval"] = rec["eval"] or {"per_node": []}
        target["per_node"].append(entry)
        for metric in ("loss", "accuracy"):
            target[metric] = weighted_metric(
                [(e["metrics"][metric], e["num_examples"]) for e in target["per_node"]
                 if metric in e["metrics"]]
            )
        target["num_examples"] = sum(e["num_examples"] for e in target["per_node"])
        target["nodes"] = len(target["per_node"])

    def _maybe_done(self, rnd: RoundState) -> None:
        if rnd.outstanding() == 0:
            rnd.done.set()

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "global_round": self.global_round,
            "job": self.job.to_dict(),
            "strategy": self.strategy.state(),
            "history": self.history,
            "initial_eval": self.initial_eval,
            "rejections": dict(self.rejections),
            "started_at": self.started_at,
            "completed": self.completed,
        }

    def evaluated_accuracy(self) -> float | None:
        for rec in reversed(self.history):
            if rec.get("eval") and rec["eval"].get("accuracy") is not None:
                return float(rec["eval"]["accuracy"])
        return None


def _resources(r: pb.RoundResources) -> dict[str, Any]:
    return {
        "device": r.device,
        "gpu_uuid": r.gpu_uuid or None,
        "nvml_used_before_mib": _opt(r.nvml_used_before_mib),
        "nvml_used_peak_mib": _opt(r.nvml_used_peak_mib),
        "nvml_used_after_mib": _opt(r.nvml_used_after_mib),
        "torch_peak_allocated_mib": _opt(r.torch_peak_allocated_mib),
        "torch_peak_reserved_mib": _opt(r.torch_peak_reserved_mib),
        "rss_peak_mib": _opt(r.rss_peak_mib),
        "train_seconds": round(r.train_seconds, 3),
        "round_seconds": round(r.round_seconds, 3),
        "queued_seconds": round(r.queued_seconds, 3),
    }


def _opt(v: int) -> int | None:
    return None if v < 0 else int(v)
