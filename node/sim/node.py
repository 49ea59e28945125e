"""One simulated node: the real wire protocol, synthetic weights, no torch, many per process.

Each simulated node registers, heartbeats, long-polls for tasks and answers them exactly as a
real agent does (node/wire_client.py's WireClient, the agent's own client: same stubs, same
payloads with their BLAKE3 digest, over the aggregator's bulk port when it has one and gRPC
chunks otherwise), but its "training" is a cheap synthetic update of the global model's shapes.

It also lives as the agent does. An aggregator that goes away (a restart, an upgrade) is waited
for with the agent's backoff (node/retry.py: full jitter up to a cap), a node the aggregator no
longer knows registers again, and a node whose task loop ends (told to stop, or an error no
retry fixes) stops heartbeating with it: the aggregator must never see a node "alive" that
would not answer the task it is sampled for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import grpc
import numpy as np

import fedgpu
from fedgpu.core import bulk, codec, digests, tls_diagnosis
from fedgpu.core.buffers import BufferPool
from fedgpu.core.digest_sink import DigestSink
from fedgpu.node.pulled import PayloadError
from fedgpu.node.retry import RetryPolicy
from fedgpu.node.sim import personal, secure, statistics, synthetic
from fedgpu.node.sim.records import SimConfig, SimStats
from fedgpu.node.wire_client import WireClient, is_unreachable
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.sim")

# The global model's buffers, given back after each answer and kept warm for the next round's
# download (a fresh buffer costs a page fault per page: see fedgpu.core.buffers).
DOWNLOADS = BufferPool(1 << 30)

KIND_NAMES = {pb.TASK_KIND_INIT: "init", pb.TASK_KIND_TRAIN: "train",
              pb.TASK_KIND_EVALUATE: "evaluate", pb.TASK_KIND_STATISTICS: "statistics"}


class RegisterFailed(Exception):
    """The first registration cannot succeed: no aggregator within the simulation's connect
    timeout, or one that refuses us for a reason a retry does not change (TLS, a wrong port;
    the message names it, from fedgpu/core/tls_diagnosis.py)."""


class SimNode:
    """A simulated site: node/wire_client.py's WireClient, as the agent uses it, with a cheap
    synthetic update instead of training."""

    def __init__(self, index: int, cfg: SimConfig, channel: grpc.aio.Channel, stats: SimStats,
                 noise: synthetic.Noise) -> None:
        self.index = index
        self.name = f"{cfg.prefix}-{index:05d}"
        self.cfg = cfg
        self.wire = WireClient(cfg.aggregator, cfg.token, cfg.tls, channel=channel)
        self.stats = stats
        self.noise = noise
        self.node_id = ""
        self.heartbeat_s = 5
        self.max_bytes = 4 << 30
        self.state = "idle"
        self.examples = 10 + index % 90
        self.policy = RetryPolicy(cfg.retry_base_s, cfg.retry_cap_s)
        # Set by a heartbeat the aggregator answered with "unknown node".
        self._reregister = asyncio.Event()
        self.heartbeating = False
        # The job's local_params tensors: they stay here, as on a real site.
        self.layers = personal.LocalLayers()

    # ---- registration ------------------------------------------------------------------

    async def register(self, deadline: float | None, diagnose: bool = False) -> None:
        """Register, waiting out an unreachable aggregator with jittered backoff until
        `deadline` (time.monotonic(); None: for as long as the node runs). With `diagnose`,
        a failure that is not an outage (TLS, a wrong port) ends it at once, named."""
        req = pb.RegisterRequest(
            node_name=self.name, version=fedgpu.__version__,
            devices=pb.DeviceInventory(nvml_available=False, nvml_reason="simulated node"),
            decision=pb.GpuDecision(mode="none", device="cpu", gpu_index=-1,
                                    reason="simulated node: no training, no GPU"),
            labels={"simulated": "true"},
            # Its training-set size, stated as an agent does: what its updates claim below.
            num_examples=self.examples,
        )
        attempt = 0
        while True:
            try:
                reply = await self.wire.register(req, timeout=30)
                break
            except grpc.aio.AioRpcError as exc:
                if not is_unreachable(exc):
                    raise
                if diagnose and attempt == 0:
                    why = await asyncio.to_thread(tls_diagnosis.diagnose, self.cfg.aggregator,
                                                  self.cfg.tls)
                    if why is not None:
                        raise RegisterFailed(str(why)) from None
                attempt += 1
                delay = self.policy.delay(attempt)
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise RegisterFailed(f"{self.name}: no aggregator at "
                                         f"{self.cfg.aggregator}: {exc.code().name}") from None
                await asyncio.sleep(delay)
        self.node_id = reply.node_id
        self.heartbeat_s = max(1, reply.heartbeat_interval_s)
        self.max_bytes = reply.max_update_bytes or self.max_bytes
        self._reregister.clear()

    # ---- its life: heartbeats for as long as its task loop runs ------------------------

    async def run(self) -> None:
        """The task loop with its heartbeats beside it; both end together."""
        beats = asyncio.create_task(self.heartbeats())
        try:
            await self.serve()
            self.stats.ended += 1  # on its own; a node stopped with the process is not counted
        finally:
            beats.cancel()
            await asyncio.gather(beats, return_exceptions=True)

    async def heartbeats(self) -> None:
        self.heartbeating = True
        try:
            # Spread over the interval so a thousand nodes don't beat in the same millisecond.
            await asyncio.sleep((self.index % 97) / 97 * self.heartbeat_s)
            while True:
                if not self._reregister.is_set():
                    try:
                        reply = await self.wire.heartbeat(
                            pb.HeartbeatRequest(node_id=self.node_id, state=self.state),
                            timeout=max(2, self.heartbeat_s))
                    except grpc.aio.AioRpcError:
                        pass  # the task loop notices an outage and waits it out
                    else:
                        if not reply.known:
                            self._reregister.set()
                await asyncio.sleep(self.heartbeat_s)
        finally:
            self.heartbeating = False

    async def serve(self) -> None:
        """Long-poll and answer until the aggregator says stop or an error no retry fixes."""
        attempt = 0
        while True:
            if self._reregister.is_set():
                log.info("%s: the aggregator no longer knows us; registering again", self.name)
                await self.register(deadline=None)
                self.stats.reregistered += 1
                continue
            try:
                pulled = await self.wire.pull(self.node_id, self.cfg.poll_s, self.max_bytes,
                                              self._receiver)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    self._reregister.set()
                    continue
                if not is_unreachable(exc):
                    # As the agent: a refusal another try cannot fix ends this node.
                    self.stats.errors.append(f"{self.name} pull: {exc.code().name} "
                                             f"{exc.details()}")
                    return
                attempt += 1
                self.state = "reconnecting"
                await asyncio.sleep(self.policy.delay(attempt))
                continue
            except PayloadError as exc:
                # Broken before its header (asked again) or a payload it cannot use.
                if exc.header is not None:
                    self.stats.errors.append(f"{self.name} pull: {exc}")
                attempt += 1
                await asyncio.sleep(self.policy.delay(attempt))
                continue
            finally:
                self._note_fallback()
            if attempt:
                self.stats.reconnects += 1
                attempt = 0
                self.state = "idle"
            header = pulled.header
            if header.kind == pb.TASK_KIND_NONE:
                continue
            if header.kind == pb.TASK_KIND_SHUTDOWN:
                return
            kind = KIND_NAMES.get(header.kind, "unknown")
            self.stats.tasks[kind] = self.stats.tasks.get(kind, 0) + 1
            if header.payload_size:
                self.stats.pulls.append({"bytes": float(header.payload_size),
                                         "seconds": round(pulled.seconds, 6),
                                         "transport": pulled.transport})
            try:
                await self._answer(header, pulled.payload)
            finally:
                pulled.payload = None
                if isinstance(pulled.receiver, codec.Assembler):
                    pulled.receiver.release()

    # ---- answers -----------------------------------------------------------------------

    def _note_fallback(self) -> None:
        if self.wire.bulk.error:
            self.stats.bulk_errors.append(self.wire.bulk.error)

    def _receiver(self, header: pb.TaskHeader) -> codec.Assembler | DigestSink:
        algo, digest = digests.of_header(header)
        if self.cfg.update_file is not None:
            return DigestSink(header.payload_size, digest, algo,
                                   segment_digests=header.payload_segment_digests)
        return codec.Assembler(header.payload_size, digest, self.max_bytes, algo, DOWNLOADS,
                               header.payload_segment_digests)

    def _update(self, header: pb.TaskHeader, payload: memoryview | None
                ) -> dict[str, np.ndarray] | None:
        if self.cfg.update_file is not None:
            return None
        if header.kind == pb.TASK_KIND_INIT:
            return synthetic.synthetic_model(self.cfg.params, self.cfg.tensors, seed=header.seed)
        if header.kind != pb.TASK_KIND_TRAIN or payload is None or header.secagg_setup:
            return None  # a secure round's change is made in _secure
        patterns, run = personal.ask_of(header.hyperparameters_json)
        return synthetic.trained(self.noise, self.index, header, payload,
                                 self.layers if patterns else None, patterns, run)

    def _header(self, task: pb.TaskHeader) -> pb.UpdateHeader:
        update = pb.UpdateHeader(
            node_id=self.node_id, task_id=task.task_id, round=task.round, kind=task.kind,
            evaluated_round=task.evaluated_round,
            # A statistics answer states its records, as a training one its examples.
            num_examples=self.examples if task.kind != pb.TASK_KIND_EVALUATE else 0,
        )
        update.decision.CopyFrom(pb.GpuDecision(mode="none", device="cpu", gpu_index=-1,
                                                reason="simulated node"))
        update.resources.CopyFrom(pb.RoundResources(
            device="cpu", nvml_used_before_mib=-1, nvml_used_peak_mib=-1,
            nvml_used_after_mib=-1, torch_peak_allocated_mib=-1,
            torch_peak_reserved_mib=-1, rss_peak_mib=-1))
        if task.kind in (pb.TASK_KIND_TRAIN, pb.TASK_KIND_EVALUATE):
            # A synthetic learning curve, so status/rounds show something that moves.
            r = task.evaluated_round
            update.eval_metrics.update({"loss": 2.3 / (1 + r), "accuracy": 1 - 0.9 / (1 + r)})
            update.num_eval_examples = 20
        if task.kind == pb.TASK_KIND_TRAIN:
            update.train_metrics.update({"loss": 2.0 / (1 + task.round)})
        return update

    async def _secure(self, task: pb.TaskHeader, payload: memoryview,
                      update: pb.UpdateHeader) -> None:
        patterns, run = personal.ask_of(task.hyperparameters_json)
        change = await asyncio.to_thread(synthetic.secure_change, self.noise, self.index,
                                         task, payload, self.layers if patterns else None,
                                         patterns, run)
        try:
            why = await secure.answer(self.wire, self.node_id, self.cfg.poll_s, self.max_bytes,
                                      task, update, change)
        finally:
            self._note_fallback()
        if why is not None:
            self.stats.errors.append(f"{self.name}: {why}")

    async def _push(self, update: pb.UpdateHeader, source: codec.Encoded | Path | None
                    ) -> str:
        """Send an update, waiting out an aggregator that is briefly away as the agent does
        (until `report_timeout_s`); the path it took."""
        end = time.monotonic() + self.cfg.report_timeout_s
        attempt = 0
        while True:
            try:
                _, transport = await self.wire.push(update, source)
                return transport
            except grpc.aio.AioRpcError as exc:
                attempt += 1
                delay = self.policy.delay(attempt)
                if not is_unreachable(exc) or time.monotonic() + delay > end:
                    raise
                await asyncio.sleep(delay)

    async def _answer(self, header: pb.TaskHeader, payload: memoryview | None) -> None:
        if header.kind not in KIND_NAMES:
            return  # a secure round's relay after its protocol stopped: nothing to answer
        self.state = "training"
        try:
            update = self._header(header)
            try:
                weights = await asyncio.to_thread(self._update, header, payload)
                if header.kind == pb.TASK_KIND_TRAIN and header.secagg_setup \
                        and payload is not None:
                    await self._secure(header, payload, update)
                    return
            except personal.BadLocalParams as exc:
                # As the agent's runner: the round fails on the node, saying why.
                weights, update.failed, update.error = None, True, str(exc)
            if header.kind == pb.TASK_KIND_STATISTICS:
                # Held back and noised by the site's own release code, as on a real site.
                statistics.answer(header, update, self.index, self.examples)
            source: codec.Encoded | Path | None = None
            if update.failed:
                pass  # nothing but the reason
            elif self.cfg.update_file is not None and header.kind in (pb.TASK_KIND_INIT,
                                                                    pb.TASK_KIND_TRAIN):
                size, digest, segs = await asyncio.to_thread(synthetic.file_payload,
                                                             self.cfg.update_file)
                digests.stamp(update, codec.WIRE_DIGEST, digest)
                update.payload_segment_digests = segs
                source = self.cfg.update_file
            elif weights is not None:
                source = await asyncio.to_thread(codec.encode, weights)
            started = time.perf_counter()
            try:
                transport = await self._push(update, source)
            except grpc.RpcError as exc:
                self.stats.errors.append(f"{self.name} push: {exc.code().name} {exc.details()}")
                return
            except (bulk.RefusedError, OSError, bulk.BulkProtocolError) as exc:
                self.stats.errors.append(f"{self.name} bulk push: {exc}")
                return
            finally:
                self._note_fallback()
            if source is not None:
                self.stats.pushes.append({"bytes": float(update.payload_size),
                                          "seconds": round(time.perf_counter() - started, 6),
                                          "transport": transport})
        finally:
            self.state = "idle"
