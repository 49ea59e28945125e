"""The node agent: dial out, register, long-poll for tasks, run each in a process of its own.

It survives the aggregator going away: register, pull and report go through one retry rule
(node/retry.py: exponential backoff with jitter, a deadline per call site), and a node the
aggregator no longer knows registers again. A task it cannot take (a payload over its limit, a
round that cannot start) is reported to the aggregator as a failed task; the agent stays up.
A job whose [resources] its GPUs cannot give now is answered "ineligible" (no failure), and a
task the aggregator abandons (node/liveness.py) has its worker killed and is not answered.
An aggregator that stops (restart, upgrade, crash) never ends the agent: it polls until the
aggregator is back. It exits only when retired (`nodes forget`, `server stop --retire-nodes`).
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from fedgpu.core.admission_wire import resources_from_wire
from fedgpu.core.audit import AUDIT_FILE, AuditLog
from fedgpu.core.bundles import MAX_BUNDLE_BYTES
from fedgpu.core.constants import TaskApproval
from fedgpu.core.errors import FedgpuError
from fedgpu.core.site_policy import REFUSAL_PREFIX
from fedgpu.node import identity, messages, nvml, policy, registration, secagg, task_needs
from fedgpu.node.agent_config import AgentConfig
from fedgpu.node.approvals import default_state_dir
from fedgpu.node.bundle_keeper import BundleKeeper
from fedgpu.node.client import AggregatorClient, PayloadError, PayloadTooLarge, is_unreachable
from fedgpu.node.gpu_admission import GpuAdmission
from fedgpu.node.gpu_sampler import MemorySampler
from fedgpu.node.liveness import Liveness, cut_off
from fedgpu.node.local_models import LocalModels
from fedgpu.node.retry import Repeats, RetryPolicy, Stopped, retry
from fedgpu.node.round_launch import launch
from fedgpu.node.rounds.factory_client import FactoryClient
from fedgpu.node.rounds.process import (
    SIMULATED_GPUS_ENV,
    SIMULATED_GPUS_WARNING,
    RoundOutcome,
    Worker,
    simulated_gpus,
)
from fedgpu.node.rounds.workfiles import KINDS
from fedgpu.node.site_rules import SiteRules
from fedgpu.node.status import write_status
from fedgpu.node.task_slots import TaskSlots
from fedgpu.node.unacked import UnackedUpdates, answer_from_kept
from fedgpu.node.unmask_ledger import FILE_NAME as UNMASK_LEDGER
from fedgpu.node.unmask_ledger import UnmaskLedger
from fedgpu.node.update_report import KIND_NAMES, build_update
from fedgpu.node.update_sender import UpdateSender
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node")


class Agent:
    """One node: registers, pulls tasks, runs each in a round worker, reports, heartbeats."""

    def __init__(self, cfg: AgentConfig, factory: FactoryClient | None = None) -> None:
        """`factory`: a client shared with other agents of this process (node/fleet.py)."""
        self.cfg = cfg
        # The aggregator's last word on an empty poll (why it left this site out), logged once.
        self._told = ""
        state_dir = cfg.state_dir or default_state_dir()
        self.identity = identity.claim_or_anonymous(state_dir, cfg.name)
        # One unmasking per global model, remembered across restarts (node/unmask_ledger.py).
        self.unmasked = UnmaskLedger(self.identity.folder / UNMASK_LEDGER)
        # Under mutual TLS the site signs its secure-aggregation keys with its TLS key.
        self.secagg_identity = secagg.secagg_identity(cfg.tls)
        # The site's audit log: tasks run and refused here, beside its approvals' records.
        self.audit = AuditLog(state_dir / AUDIT_FILE)
        # The site's own policy: checked on every task before anything else (node/site_rules.py).
        self.rules = SiteRules(cfg.site_policy, state_dir, self.audit)
        # Updates sent but not acknowledged: sent again, never trained again (node/unacked.py).
        self.unacked = UnackedUpdates(self.identity.folder / "unacknowledged")
        cfg.name = self.identity.name
        self.client = AggregatorClient(cfg.aggregator, cfg.token, tls=cfg.tls)
        self.node_id: str | None = None
        self.heartbeat_s = 5
        self.max_task_bytes = cfg.max_payload_bytes
        self.state = "starting"
        self.decision: policy.Decision | None = None
        self._stop = threading.Event()
        self._reregister = threading.Event()
        self._registrations = Repeats()
        self._sampler = MemorySampler()
        self._factory = factory if cfg.prestart else None
        self._owns_factory = False
        # The round worker each slot's thread runs now (--slots: several at once).
        self._workers: dict[int, Worker] = {}
        self._registering = threading.Lock()
        # GPU memory admitted to each running task, so that slots do not share it twice.
        self.gpus = GpuAdmission(cfg.gpu)
        # Heartbeats: the task in hand and the GPUs' free memory out, "abandon it" back.
        self.liveness = Liveness(self.client, cfg.gpu)
        self.bundles = BundleKeeper(
            cfg.task_approval, state_dir,
            lambda sha: self.client.fetch_bundle(self.node_id or "", sha, MAX_BUNDLE_BYTES))
        # Its last local model of each training job, for cross-site evaluation.
        self.local_models = LocalModels(self.identity.folder, cfg.max_payload_bytes,
                                        self.audit, f"aggregator {cfg.aggregator}")
        # Answers go out with the retry rule; every task leaves a record in the site's audit.
        self.sender = UpdateSender(self.client, lambda: self._policy(cfg.report_timeout_s),
                                   self._stop, self.audit, cfg.aggregator)
        # The bundles the aggregator last offered; every heartbeat answers about them.
        self._offers: list[pb.TaskBundle] = []

    # ---- start-up ----------------------------------------------------------------------

    def start_decision(self) -> policy.Decision:
        self.snapshot = snap = nvml.snapshot()
        # Raises EnforceError (exit non-zero) when --gpu enforce finds no usable GPU.
        policy.check_startup(snap, self.cfg.gpu)
        # The job's use_gpu is known only with the first task; report what "yes" would mean.
        self.decision = policy.decide(snap, self.cfg.gpu, job_use_gpu=True)
        log.info("%s", policy.log_line(self.decision))
        if simulated_gpus():
            log.warning(SIMULATED_GPUS_WARNING, SIMULATED_GPUS_ENV)
        return self.decision

    def _policy(self, deadline_s: float | None) -> RetryPolicy:
        return RetryPolicy(self.cfg.retry_base_s, self.cfg.retry_cap_s, deadline_s)

    def register(self, deadline_s: float | None) -> None:
        """Register, retrying an unreachable aggregator for `deadline_s` (None: until stopped).

        Raises Stopped when the agent is stopped meanwhile.
        """
        assert self.decision is not None
        request = registration.request(
            self.cfg, self.identity.secret, self.snapshot, self.decision,
            self.liveness.capacity(self.snapshot), str(self.bundles.mode))
        reply = registration.register(self.client, self.cfg, request, self._registrations,
                                      self._policy(deadline_s), self._stop)
        self.node_id = reply.node_id
        self.heartbeat_s = max(1, reply.heartbeat_interval_s)
        self.max_task_bytes = min(self.cfg.max_payload_bytes,
                                  reply.max_update_bytes or self.cfg.max_payload_bytes)
        if reply.chunk_size:
            self.client.chunk_size = reply.chunk_size
        self._offers = list(reply.offers)
        self._reregister.clear()
        log.info("registered with %s as %s (run %s)", self.cfg.aggregator, self.node_id,
                 reply.run_id)
        self._set_state("idle")

    # ---- main loop ---------------------------------------------------------------------

    def run(self) -> int:
        self.start_decision()
        (log.warning if self.bundles.mode == TaskApproval.ANY else log.info)(
            "%s", self.bundles.start_line())
        self._sampler.__enter__()
        try:
            self.register(deadline_s=self.cfg.connect_timeout_s)
            if self.cfg.prestart and self._factory is None:
                self._start_factory()
            # Named for the node: an agent may share its process with others (node/fleet.py).
            beat = threading.Thread(target=self._heartbeats, name=f"{self.cfg.name}:heartbeat",
                                    daemon=True)
            beat.start()
            return self._loop()
        except Stopped:
            return 0
        except registration.Retired as exc:
            log.info("the aggregator retired this node (%s); exiting", exc)
            self._set_state("retired")
            return 0
        except Exception:
            if self._stop.is_set():
                return 0  # stopped from another thread: the client was closed under us
            raise
        finally:
            self._stop.set()
            if self._owns_factory and self._factory is not None:
                self._factory.close()
            self._sampler.__exit__(None, None, None)
            self.client.close()
            self.identity.release()

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        """Stop from another thread: a running round's worker is killed, a long poll ends."""
        self._stop.set()
        for worker in list(self._workers.values()):
            worker.kill()
        self.client.close()

    def _start_factory(self) -> None:
        # Its torch import runs while the agent waits for its first task.
        self._factory = FactoryClient.for_node(self.cfg.worker_factory)
        self._owns_factory = self._factory is not None and self.cfg.worker_factory is None

    def _track(self, worker: Worker | None) -> None:
        if worker is None:
            self._workers.pop(threading.get_ident(), None)
        else:
            self._workers[threading.get_ident()] = worker

    def _lost(self, exc: BaseException, delay: float) -> None:
        if isinstance(exc, PayloadError):
            log.warning("broken task stream (%s); asking again in %.1fs", exc, delay)
            return
        code = exc.code().name if isinstance(exc, grpc.RpcError) else str(exc)
        log.warning("lost the aggregator (%s); retrying in %.1fs", code, delay)
        why = self.client.explain(exc)  # TLS or a wrong port: said once, with the fix
        if why is not None:
            log.warning("%s", why)
        self._set_state("reconnecting")

    def _pull(self) -> tuple[pb.TaskHeader, bytearray | None]:
        assert self.node_id is not None
        # The tasks the other slots work on are not handed to this one (node/task_slots.py).
        return self.client.pull(self.node_id, self.cfg.poll_s, self.max_task_bytes,
                                busy=self.liveness.running())

    def _loop(self) -> int:
        return TaskSlots(self.cfg.slots, self._serve, self._stop, self.shutdown,
                         self.cfg.name or "node").run()

    def _serve(self, slot: int) -> int:
        while not self._stop.is_set():
            if self._reregister.is_set() or self.node_id is None:
                with self._registering:  # one slot registers again, the others wait
                    if self._reregister.is_set() or self.node_id is None:
                        self.register(deadline_s=None)
                continue
            try:
                # No deadline: a node waits for its aggregator as long as it runs. A stream
                # that broke before its header said what the task was is asked for again.
                header, payload = retry(
                    self._pull, what="task poll", policy=self._policy(None),
                    retryable=lambda e: is_unreachable(e) or cut_off(e, self._stop) or (
                        isinstance(e, PayloadError) and e.header is None),
                    stop=self._stop, on_retry=self._lost)
            except PayloadError as exc:
                # The aggregator would send the same task again: say why it cannot be taken,
                # once, and let the round engine decide (retry the round, drop this node).
                assert exc.header is not None
                kind = "over this node's limit" if isinstance(exc, PayloadTooLarge) else "damaged"
                self._report(exc.header, None, f"task payload {kind}: {exc}")
                continue
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.info("aggregator no longer knows us; registering again")
                    self._reregister.set()
                    continue
                raise FedgpuError(f"aggregator error: {exc.details()}") from None
            if self.state == "reconnecting":
                self._set_state("idle")
            if header.kind == pb.TASK_KIND_NONE:
                if header.message and header.message != self._told:
                    # Why the aggregator left this site out (a slow link): logged once.
                    log.info("aggregator: %s", header.message)
                self._told = header.message
                continue
            if header.kind == pb.TASK_KIND_SHUTDOWN:
                log.info("the aggregator retired this node (%s); exiting", header.message)
                self._set_state("retired")
                return 0
            self._handle(header, payload)
        return 0

    def _handle(self, header: pb.TaskHeader, payload: bytearray | None) -> None:
        if header.kind == pb.TASK_KIND_LOCAL_MODEL:  # cross-site: nothing runs, a file is sent
            self.sender.push(header, *self.local_models.answer(
                header, self.node_id or "", self.rules.policy,
                self.rules.refusals(header, "local_model")))
            return
        kind = KIND_NAMES.get(header.kind)
        if kind is None or kind not in KINDS:
            log.warning("ignoring task of unknown kind %d", header.kind)
            return
        if header.task_id in self.liveness.running():
            # Another slot runs it (an aggregator from before slots serves it again).
            self._stop.wait(1.0)
            return
        if answer_from_kept(self.unacked, header, self.node_id or "", self.sender.push):
            return
        self._set_state("training" if kind != "evaluate" else "evaluating")
        # The GPUs as they are now, not as they were at start: admission is decided per task.
        snap = nvml.snapshot()
        outcome: RoundOutcome | None = None
        error = ""
        cancel = self.liveness.working_on(header.task_id)
        try:
            hparams_json = header.hyperparameters_json
            try:
                if reasons := self.rules.refusals(header, kind):
                    raise policy.Ineligible(REFUSAL_PREFIX + "; ".join(reasons))
                # A built-in task may refine the job's needs for this site (causal-lm: its base
                # model must be here; GPU memory estimated from its size when not given).
                need, hparams_json = task_needs.for_site(
                    header.task_name, hparams_json, self.cfg.data_dir,
                    resources_from_wire(header), bundled=header.HasField("bundle"))
                # Data-parallel training ([resources] workers): a device for each, or refused;
                # init and evaluate run in one process. Beside the other slots' tasks' memory.
                decision, decisions = self.gpus.admit(header.task_id, need, kind == "train",
                                                      snap)
            except policy.Ineligible as exc:
                log.info("round %d %s: ineligible: %s", header.round, kind, exc)
                error = f"ineligible: {exc}"
                self.sender.push(header, messages.ineligible(header, self.node_id or "",
                                                             str(exc)), None)
                return
            except (policy.EnforceError, ValueError) as exc:
                decision = None
                error = str(exc)
            if decision is not None:
                self.decision = decision
                log.info("round %d %s: %s", header.round, kind, policy.log_line(decision))
                outcome, error = launch(
                    header, kind, payload, hparams_json, decision, decisions, cfg=self.cfg,
                    bundles=self.bundles, layers_dir=self.identity.folder / "local-params",
                    sampler=self._sampler, factory=self._factory, track=self._track,
                    cancel=cancel)
                if outcome is not None and outcome.abandoned:
                    # Its answer would be refused: nothing is sent.
                    log.warning("round %d %s abandoned: %s", header.round, kind, error)
                    return
            if (outcome is not None and outcome.ok and header.kind == pb.TASK_KIND_TRAIN
                    and header.secagg_setup and payload is not None):
                # A secure round: the protocol (node/secagg.py) instead of the weights.
                secagg.answer(self.client, self.node_id or "", self.cfg.poll_s,
                              self.max_task_bytes, decision or self.decision, header,
                              outcome, payload,
                              lambda: cancel.is_set() or self._stop.is_set(),
                              self.unmasked, self.cfg.secagg_min_threshold,
                              self.secagg_identity)
                self.local_models.keep(header, None)  # its note: why none is kept
            else:
                # This task's own decision: another slot may have decided since.
                self._report(header, outcome, error, decision)
        finally:
            self.liveness.done(header.task_id)
            self.gpus.release(header.task_id)
            self.sender.audit_task(header, kind, outcome, error)
            if outcome is not None:
                self.rules.spent(header, outcome.resources)
                outcome.cleanup()
            self._set_state(self.state if self.liveness.running() else "idle")

    def _report(self, task: pb.TaskHeader, outcome: RoundOutcome | None, error: str,
                decision: policy.Decision | None = None) -> None:
        assert self.node_id is not None
        update, weights, ok = build_update(task, self.node_id, decision or self.decision,
                                           outcome, error)
        if ok and task.kind == pb.TASK_KIND_TRAIN:
            self.local_models.keep(task, weights)
        acked = self.sender.push(task, update, weights)
        if ok and (not acked or task.kind == pb.TASK_KIND_TRAIN):
            # Unacknowledged: sent again. Acknowledged training updates too: an aggregator
            # killed before the round closed reopens it and asks for them (node/unacked.py).
            self.unacked.keep(update, weights, task, acked=acked)
            if not acked:
                log.info("round %d: the update is kept (task %s): sent again if the aggregator "
                         "hands out this task again, dropped once it moves on", task.round,
                         task.task_id)

    # ---- liveness ----------------------------------------------------------------------

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if self.node_id is None or self._reregister.is_set():
                continue
            reply = self.liveness.beat(self.node_id, self.state, timeout=max(2, self.heartbeat_s),
                                       bundles=self.bundles.answer(self._offers))
            if reply is None:
                continue
            if not reply.known:
                self._reregister.set()
            if reply.shutdown:  # retired while training: its loop may not poll for long
                log.info("the aggregator retired this node; exiting")
                return self.shutdown()
            self._offers = list(reply.offers)
            self._write_status()

    def _set_state(self, state: str) -> None:
        self.state = state
        self._write_status()

    def _write_status(self) -> None:
        if self.cfg.status_file is None:
            return
        write_status(self.cfg.status_file, {
            "time": time.time(),
            "state": self.state,
            "node_id": self.node_id,
            "name": self.cfg.name,
            "aggregator": self.cfg.aggregator,
            "heartbeat_interval_s": self.heartbeat_s,
            "gpu_decision": self.decision.to_dict() if self.decision else None,
        })

