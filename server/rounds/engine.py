"""The round engine: one loop (wait for nodes, open, await, close, record, commit, retry) that
every kind of round runs through, driven by a plan (server/rounds/plans.py) that says which nodes,
which task headers and what success means. Updates arrive through its `answers`
(server/rounds/answers.py), a collaborator that reads the run through a narrow view."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.core import codec, digests, jsondoc, local_params
from fedgpu.core.admission_wire import resources_to_wire
from fedgpu.core.bundles import BundleRef
from fedgpu.core.constants import GpuNeed, RoundStatus, RunState
from fedgpu.core.job import Job
from fedgpu.core.site_policy import terms_of
from fedgpu.core.site_policy_wire import terms_to_wire
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.answers import Answers
from fedgpu.server.rounds.attempt import RoundState, RunFailed, Task
from fedgpu.server.rounds.checkpoint import Checkpointer, SavedWeights, map_weights
from fedgpu.server.rounds.eligibility import Seating, eligible_nodes, never_started
from fedgpu.server.rounds.history import History
from fedgpu.server.rounds.link_admission import LinkAdmission
from fedgpu.server.rounds.plans import EvalPlan, InitPlan, Plan, StarPlan, TrainPlan
from fedgpu.server.rounds.records import RoundRecord
from fedgpu.server.rounds.reopen import Reopener
from fedgpu.server.rounds.states import SlotState
from fedgpu.server.rounds.validation import first_non_finite
from fedgpu.server.rounds.work import configure, task_hyperparameters
from fedgpu.server.transfer.payload import ModelPayload, to_wire

log = logging.getLogger("fedgpu.server.rounds.engine")


class Orchestrator:
    def __init__(
        self,
        job: Job,
        registry: Registry,
        chunk_size: int = codec.DEFAULT_CHUNK_SIZE,
        checkpointer: Checkpointer | None = None,
        initial_weights: Mapping[str, np.ndarray] | None = None,
        plan: TrainPlan | None = None,
        bundle: BundleRef | None = None,
        job_id: str = "",
        roster: Seating | None = None,
    ) -> None:
        self.job = job
        self.job_id = job_id  # its log lines name it (a job's events, several jobs at once)
        # Its study's sites not held by another running job (server/jobs/seats.py); the
        # sites a round samples are held by this job until it ends.
        self.roster = roster
        # The task's bundle (None: installed on the nodes): named in every task header, and
        # only nodes whose site allows it are sampled (server/rounds/eligibility.py).
        self.bundle = bundle
        # What each site's own policy checks of the job (fedgpu/core/site_policy.py).
        self._terms = terms_to_wire(terms_of(job, job_id))
        self._bundle_msg = (pb.TaskBundle(sha256=bundle.sha256, size=bundle.size,
                                          name=bundle.name, entry=bundle.entry, job_id=job_id)
                            if bundle is not None else None)
        self.registry = registry
        self.chunk_size = chunk_size
        self.checkpointer = checkpointer
        # The mode's training plan brings its strategy (star: the job's; ring: the average).
        self.plan = plan if plan is not None else StarPlan(job)
        self.plan.bind(self)
        self.strategy = self.plan.strategy
        configure(self.strategy, job)
        self.run_id = secrets.token_hex(6)
        self.state = RunState.WAITING
        self.error: str | None = None
        self.started_at = time.time()
        self.finished_at: float | None = None
        self.global_weights: dict[str, np.ndarray] | None = (
            dict(initial_weights) if initial_weights is not None else None)
        self.global_spec: dict[str, tuple[str, tuple[int, ...]]] | None = (
            codec.spec(self.global_weights) if self.global_weights is not None else None)
        self.global_round = 0
        # A round was ever opened (queue_timeout_s applies only before the first).
        self.opened_any = False
        self.history = History()
        self.current: RoundState | None = None
        self.current_plan: Plan = self.plan
        self.finished = asyncio.Event()
        self._agg_lock = asyncio.Lock()
        # Checks, refusals and accepted updates of the open attempt (what nodes' answers meet).
        self.answers = Answers(self, self._agg_lock)
        # Which sites' links can carry a round in time (server/rounds/link_admission.py).
        self.links = LinkAdmission(job, registry, job_id)
        self._payload: ModelPayload | None = None
        # The file the global model was last adopted from, and the arrays mapped from it.
        self._saved: tuple[SavedWeights, dict[str, np.ndarray]] | None = None
        # True once the job has run to its end, here or before a restart (from the checkpoint).
        self.completed = False
        # True while a round waits for enough nodes that can take the job (`job status`).
        self.waiting_for_nodes = False
        # Why the run finished before its last round (a spent privacy budget); None: it did not.
        self.end_reason: str | None = None
        # The open attempt on disk, reopened by a restart in its middle (server/rounds/reopen.py).
        self.reopener = Reopener(checkpointer.directory if checkpointer is not None else None)

    @property
    def rejections(self) -> Counter[str]:
        return self.history.rejections

    def restore(self, weights: dict[str, np.ndarray], state: Mapping[str, Any]) -> None:
        """Continue a checkpointed run: the next round is the one after the last finished one
        (a round the restart interrupted runs again; none that finished runs twice)."""
        self.run_id = str(state["run_id"])
        self.global_weights = weights
        self.global_spec = codec.spec(weights)
        self.global_round = int(state["global_round"])
        self.opened_any = self.global_round > 0
        self.history.load(state)
        self.started_at = float(state.get("started_at") or self.started_at)
        self.completed = bool(state.get("completed"))
        # Optimiser arrays (FedAdam moments...) live beside the checkpoint, not in state.json.
        tensors = (self.checkpointer.load_strategy_tensors(self.global_round)
                   if self.checkpointer is not None else None)
        self.strategy.load_state(state.get("strategy") or {}, tensors)
        self._payload = None
        if self.checkpointer is not None:
            self._adopt(self.checkpointer.saved(state))
        self.reopener.restored()
        log.info("resumed run %s after round %d of %d%s", self.run_id, self.global_round,
                 self.job.rounds, " (already complete)" if self.completed else "")

    # ---- the run ---------------------------------------------------------------------

    async def run(self) -> None:
        try:
            if self.global_weights is None:
                await self._run_round(0, self._bound(InitPlan(self.job)))
                assert self.global_weights is not None
                log.info("initial model: %d tensors", len(self.global_weights))
            if self.job.local_params and (
                    why := local_params.problem(self.job.local_params, self.global_weights)):
                raise RunFailed(why)  # a typo would share what was meant to stay at the sites
            if self.global_round == 0:
                # The starting model is checkpointed too: a node drew it at random, and a run
                # resumed before round 1 finishes must train from the very same weights.
                await self.commit(self.global_weights, 0)
            self.state = RunState.RUNNING
            if not self.completed:
                if getattr(self.plan, "runs_itself", False):
                    await self.plan.run_all(self)  # type: ignore[attr-defined]  # cross-site
                for number in range(self.global_round + 1, self.job.rounds + 1):
                    self.end_reason = self.strategy.exhausted()
                    if self.end_reason is not None:
                        log.info("run %s ends before round %d: %s", self.run_id, number,
                                 self.end_reason)
                        break
                    await self._run_round(number, self.plan)
                if self.job.evaluate and self.plan.final_evaluation:
                    await self._run_round(self.job.rounds + 1, self._bound(EvalPlan(self.job)))
                self.completed = True
                # Once more with the final evaluation and `completed`, so a restart after the
                # end serves the finished run instead of evaluating again.
                await self.commit(self.global_weights, self.global_round)
            self.state = RunState.FINISHED
            self.reopener.finished()
            log.info("run %s finished: %d rounds", self.run_id, self.job.rounds)
        except RunFailed as exc:
            self.state = RunState.FAILED
            self.reopener.finished()
            self.error = str(exc)
            log.error("run failed: %s", exc)
        except asyncio.CancelledError:
            self.state = RunState.STOPPED
            raise
        finally:
            self.finished_at = time.time()
            self.current = None
            self.links.forget()
            for node in self.registry.all():
                node.wakeup.set()
            self.finished.set()

    def _bound(self, plan: Plan) -> Plan:
        plan.bind(self)
        return plan

    async def _run_round(self, number: int, plan: Plan) -> None:
        """Every attempt of round `number` until one succeeds; RunFailed when none did.

        An attempt that failed because a node answered "ineligible" costs no retry: that node
        is left out of the next attempt's pool until it reports its GPUs again."""
        error = ""
        attempt = spent = 0
        # An attempt a restart interrupted is reopened as it was (server/rounds/reopen.py).
        saved = self.reopener.take(self.run_id, number, plan, self.job,
                                   lambda: self._model_payload().digest)
        if saved is not None:
            attempt = saved.attempt - 1
            spent = min(attempt, plan.attempts() - 1)
        while spent < plan.attempts():
            attempt += 1
            pool = await self._wait_for_nodes(plan.pool_size(), plan)
            back = None
            if saved is not None and attempt == saved.attempt:
                pool = await self.reopener.gather(saved, pool, lambda: eligible_nodes(
                    self.job, self.registry.alive(), self.bundle, self.roster),
                    self.job.round_deadline_s)
                back = self.reopener.sites(saved, pool, plan.required(pool))
            chosen = back if back is not None else plan.choose(pool, number, attempt)
            if self.roster is not None:
                self.roster.claim(chosen)  # no await since the pool was read: no other job
            rnd = self._open(number, attempt, chosen, plan,
                             saved.tasks if saved is not None and back is not None else None)
            if plan.aggregates:
                assert self.global_weights is not None
                async with self._agg_lock:
                    self.strategy.begin_round(self.shared_weights)
            await self._await(rnd, plan)
            ok = plan.succeeded(rnd)
            new = None
            if ok and plan.aggregates:
                new = await self._aggregate(rnd)
                ok = new is not None
            self._close(rnd)
            # Recorded before the checkpoint is written, so the round is in its history.
            record = (self._record(rnd, RoundStatus.FINISHED if ok else RoundStatus.RETRIED)
                      if plan.recorded else None)
            if record is not None and self.links.applies(plan.kind, plan.sends_model) and (
                    link := self.links.record([n.name for n in chosen])):
                record.extra["link"] = link  # slow sites left out, rates (`fedgpu rounds`)
            if ok and record is not None and (report := self.strategy.round_report()):
                record.extra["privacy"] = report  # the spent epsilon, in `fedgpu rounds`
            error = plan.closed(rnd, record, chosen, ok)
            if ok:
                if new is not None:
                    await self.commit(new, number)
                elif plan.advances:
                    self.global_round = number  # committed with the run's end
                elif plan is self.plan and record is not None:
                    # A job's round that makes no model (an evaluate job's): the round is
                    # done, its model the one it was given.
                    assert self.global_weights is not None
                    await self.commit(self.global_weights, number)
                return
            if not rnd.ineligible:
                spent += 1
        raise RunFailed(plan.give_up(number, error))

    async def _aggregate(self, rnd: RoundState) -> dict[str, np.ndarray] | None:
        """The round's new global model; None (and rnd.error) when it is not finite, so that
        a poisoned model is never committed, checkpointed or sent to the nodes."""
        async with self._agg_lock:
            # From here on an update that arrives is late: the strategy is being finished.
            rnd.closed = True
            t0 = time.perf_counter()
            new = await asyncio.to_thread(self.strategy.finish)
            bad = await asyncio.to_thread(first_non_finite, new)
            rnd.aggregation_s += time.perf_counter() - t0
        problem = (f"tensor {bad!r} of the aggregate holds NaN or Inf" if bad is not None
                   else self.strategy.pending_problem())
        if problem is not None:
            rnd.error = (f"round {rnd.number} attempt {rnd.attempt}: {problem}; the round is "
                         "retried from the previous model")
            return None
        self.strategy.commit()
        # Local tensors (local_params) keep the global model's own copy: no update had them.
        return local_params.merged(self.global_weights or {}, new, self.job.local_params)

    async def _wait_for_nodes(self, needed: int, plan: Plan | None = None) -> list[Node]:
        last_log = 0.0
        since = time.monotonic()
        while True:
            alive = eligible_nodes(self.job, self.registry.alive(), self.bundle,
                                   self.roster)
            if plan is not None and self.links.applies(plan.kind, plan.sends_model):
                # Sites whose links cannot make the deadline are left out (or compress).
                alive = self.links.sort(alive, self._model_payload().size)
            if len(alive) >= needed:
                self.waiting_for_nodes = False
                self.opened_any = True
                return alive
            self.waiting_for_nodes = True
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

    @property
    def shared_weights(self) -> dict[str, np.ndarray]:
        """The global model less its local tensors (local_params): what updates hold."""
        assert self.global_weights is not None
        if not self.job.local_params:
            return self.global_weights  # the very arrays: strategies may reuse them
        return local_params.shared(self.global_weights, self.job.local_params)

    def take_initial(self, tensors: dict[str, np.ndarray]) -> None:
        self.global_weights = {k: np.array(v) for k, v in tensors.items()}
        self.global_spec = codec.spec(self.global_weights)
        self._payload = None

    @property
    def payload_size(self) -> int:
        """Bytes of the model being sent to the sites (0: none encoded yet)."""
        return self._payload.size if self._payload is not None else 0

    def _model_payload(self) -> ModelPayload:
        # Encoded once per global model and shared by every node's download; after a
        # checkpoint it is the checkpoint's file (set in commit).
        if self._payload is None:
            assert self.global_weights is not None
            enc = codec.encode(to_wire(self.global_weights, self.job.wire_dtype),
                               {"global_round": str(self.global_round)})
            self._payload = ModelPayload.from_encoded(enc)
        return self._payload

    def _open(self, number: int, attempt: int, chosen: list[Node], plan: Plan,
              task_ids: Mapping[str, str] | None = None) -> RoundState:
        now = time.time()
        rnd = RoundState(number=number, kind=plan.kind, attempt=attempt,
                         required=plan.required(chosen),
                         deadline=now + self.job.round_deadline_s, started=now)
        payload = self._model_payload() if plan.sends_model else None
        per_node = plan.task_fields(number, attempt, chosen)
        for node, fields in zip(chosen, per_node, strict=True):
            task_id = (task_ids or {}).get(node.name) or secrets.token_hex(8)
            header = pb.TaskHeader(
                task_id=task_id,
                round=number,
                kind=plan.kind,
                task_name=self.job.task,
                hyperparameters_json=json.dumps(self.links.hyperparameters(
                    node, task_hyperparameters(self.job, self.run_id), self.run_id)),
                use_gpu=self.job.needs.gpu is not GpuNeed.NONE,
                resources=resources_to_wire(self.job.needs),
                payload_size=payload.size if payload is not None else 0,
                evaluated_round=plan.evaluated_round,
                bundle=self._bundle_msg,
                job_terms=self._terms,
                **fields,
            )
            if payload is not None:
                digests.stamp(header, payload.algorithm, payload.digest)
                header.payload_segment_digests = payload.segment_digests()
            node.assigned[self.job_id] = Task(task_id, number, plan.kind, header, payload)
            node.wakeup.set()
            rnd.slots[node.node_id] = SlotState.ASSIGNED
            rnd.task_ids[node.node_id] = task_id
        plan.opened(rnd)
        if payload is not None:
            self.reopener.opened(self.run_id, rnd, chosen, plan, self.job, payload.digest)
        self.current, self.current_plan = rnd, plan
        log.info("%s", plan.describe(rnd, chosen))
        return rnd

    async def _await(self, rnd: RoundState, plan: Plan) -> None:
        while not rnd.done.is_set():
            now = time.time()
            if (now >= rnd.deadline or rnd.hopeless()
                    or plan.stop_waiting(rnd, self.registry, now)):
                break
            # Wake regularly: a participant that vanished can't answer, but may be replaced.
            try:
                await asyncio.wait_for(rnd.done.wait(), timeout=min(rnd.deadline - now, 1.0))
            except TimeoutError:
                pass

    def _close(self, rnd: RoundState) -> None:
        rnd.closed = True
        for node_id, state in rnd.slots.items():
            node = self.registry.get(node_id)
            if (state in (SlotState.ASSIGNED, SlotState.UPLOADING)
                    and self.current_plan.carries(rnd, node_id)):
                continue  # async: still training (or sending), its update joins a later step
            if state in (SlotState.ASSIGNED, SlotState.UPLOADING):
                rnd.slots[node_id] = SlotState.DROPPED
                log.info("round %d: %s dropped (no update by the deadline)", rnd.number, node_id)
            held = node.assigned.get(self.job_id) if node is not None else None
            if node is not None and held is not None and held.round == rnd.number:
                del node.assigned[self.job_id]
        self.current = None

    def _record(self, rnd: RoundState, status: RoundStatus) -> RoundRecord:
        record = rnd.record(status, time.time())
        self.history.append(record)
        return record

    async def commit(self, weights: dict[str, np.ndarray], number: int) -> None:
        """Checkpoint the run with `weights` as the global model of round `number`, then make
        them the global model: the round count moves up only once its file is committed, so
        `job model` never serves an older model than the status announces."""
        saved = None
        if self.checkpointer is not None:
            # Written in a thread (encode, fsync: seconds for a multi-GB model); the state is
            # copied here, on the loop, as late evaluations keep landing in the history. Strict
            # JSON: state.json is read by `fedgpu report` and other tools.
            state = json.loads(jsondoc.dumps({**self.checkpoint_state(),
                                               "global_round": number}))
            # The model adopted from its file and unchanged (the last commit of a run, with
            # its final evaluation): that file stays, nothing is encoded or written again.
            same = (self._saved[0] if self._saved is not None and self._saved[1] is weights
                    else None)
            saved = await asyncio.to_thread(self.checkpointer.save, weights, state,
                                            tensors=self.strategy.tensor_state(), same_as=same)
        self.global_weights = weights
        self.global_round = number
        self._payload = None
        self._adopt(saved)

    def _adopt(self, saved: SavedWeights | None) -> None:
        """Serve and hold the global model from its checkpoint file: downloads read the file,
        and the arrays become read-only views of it, so the aggregate they were computed in
        is freed (a multi-GB model is not kept twice)."""
        if saved is None:
            return
        if self.job.wire_dtype is None:
            # In half precision the nodes get an encoding of their own (_model_payload).
            self._payload = ModelPayload.from_file(saved.path, saved.digest, saved.algorithm,
                                                  saved.segment_digests)
        self.global_weights = map_weights(saved.path)
        self._saved = (saved, self.global_weights)

    def checkpoint_state(self) -> dict[str, Any]:
        # The history keys go to the job's state store, the rest to state.json
        # (server/jobs/job_checkpoint.py).
        history = self.history.state()
        return {
            "run_id": self.run_id,
            "global_round": self.global_round,
            "job": self.job.to_dict(),
            "strategy": self.strategy.state(),
            "history": history["history"],
            "initial_eval": history["initial_eval"],
            "rejections": history["rejections"],
            "started_at": self.started_at,
            "completed": self.completed,
            **self.plan.checkpoint_extra(),
        }

    def rounds_doc(self) -> dict[str, Any]:
        return self.history.doc(self.run_id)  # `fedgpu rounds --json`

    def task_for(self, node: Node) -> Task | None:
        task = node.assigned.get(self.job_id)
        rnd = self.current
        # The task must be this engine's own: a task left from a stopped job is never served.
        if task is None or rnd is None or rnd.task_ids.get(node.node_id) != task.task_id:
            return None
        return task
