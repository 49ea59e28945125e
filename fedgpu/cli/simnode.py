"""Simulated nodes: the real wire protocol, synthetic weights, no torch, many per process.

For scale tests and benchmarks. Each simulated node registers, heartbeats, long-polls for tasks
and answers them exactly as a real agent does (same stubs, same payloads with their BLAKE3
digest, over the aggregator's bulk port when it has one and gRPC chunks otherwise), but its
"training" is a cheap synthetic update of the global model's shapes. All nodes of a process
share one asyncio loop on grpc.aio, so a thousand of them cost a few hundred MB and no thread
each (a bulk transfer runs on a thread while it lasts). The wire is the node layer's own client
(node/wire_client.py), the one the agent uses: the simulation measures the real client.

With `update_file`, every node's update is that safetensors file, sent from disk, and the
models it downloads are checked against their digest and dropped: big-model benchmarks (six
3.4 GB updates) then fit in one machine's memory.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import signal
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

import fedgpu
from fedgpu.core import bulk, codec, digests
from fedgpu.core.buffers import BufferPool
from fedgpu.core.tls import TlsFiles
from fedgpu.core.transport import aio_channel
from fedgpu.node.wire_client import PayloadError, WireClient, is_unreachable
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.sim")


@dataclass
class SimConfig:
    aggregator: str
    token: str | None
    nodes: int
    prefix: str = "sim"
    start_index: int = 0
    params: int = 1_000_000
    tensors: int = 20
    poll_s: int = 25
    # Nodes that share one HTTP/2 connection; 1 = a connection per node, as real sites have.
    nodes_per_channel: int = 1
    connect_timeout_s: float = 120.0
    stats_file: Path | None = None
    # Send this safetensors file as every update, and keep no downloaded model.
    update_file: Path | None = None
    # TLS (mutual with a certificate) on gRPC and on the bulk port, as `fedgpu node start`.
    tls: TlsFiles | None = None


@functools.lru_cache(maxsize=4)
def file_payload(path: Path) -> tuple[int, str]:
    """(size, BLAKE3) of an update file, hashed once per process."""
    return path.stat().st_size, codec.digest_file(path, codec.WIRE_DIGEST)


def model_shapes(params: int, tensors: int) -> dict[str, tuple[int, ...]]:
    """`tensors` float32 tensors totalling `params` elements (the last one takes the rest)."""
    if params < tensors or tensors < 1:
        raise ValueError("need at least one parameter per tensor")
    each = params // tensors
    sizes = [each] * (tensors - 1) + [params - each * (tensors - 1)]
    shapes: dict[str, tuple[int, ...]] = {}
    for i, n in enumerate(sizes):
        # Two-dimensional where it divides, like the weight matrices of a real model.
        cols = 256 if n % 256 == 0 else 1
        shapes[f"layer{i:03d}.weight"] = (n // cols, cols) if cols > 1 else (n,)
    return shapes


def synthetic_model(params: int, tensors: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape, dtype=np.float32) * 0.05)
            for name, shape in model_shapes(params, tensors).items()}


@dataclass
class SimStats:
    registered: int = 0
    register_seconds: float = 0.0
    tasks: dict[str, int] = field(default_factory=dict)
    pushes: list[dict[str, float]] = field(default_factory=list)
    pulls: list[dict[str, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # Why nodes fell back to gRPC (the bulk port could not be reached).
    bulk_errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "registered": self.registered,
            "register_seconds": round(self.register_seconds, 3),
            "tasks": self.tasks,
            "pushes": self.pushes,
            "pulls": self.pulls,
            "errors": self.errors[:20],
            "bulk_errors": sorted(set(self.bulk_errors))[:20],
        }


class _Noise:
    """One random direction per tensor shared by all nodes of the process; each node scales
    it by its own factor, so updates differ without generating K random models per round."""

    def __init__(self) -> None:
        self._arrays: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = (name, shape)
        if key not in self._arrays:
            # crc32, not hash(): str hashes change per process and the noise must not.
            rng = np.random.default_rng(zlib.crc32(f"{name}{shape}".encode()))
            self._arrays[key] = rng.standard_normal(shape, dtype=np.float32) * 0.01
        return self._arrays[key]


# The global model's buffers, given back after each answer and kept warm for the next round's
# download (a fresh buffer costs a page fault per page: see fedgpu.core.buffers).
DOWNLOADS = BufferPool(1 << 30)


class SimNode:
    """A simulated site: node/wire_client.py's WireClient, as the agent uses it, with a cheap
    synthetic update instead of training."""

    def __init__(self, index: int, cfg: SimConfig, channel: grpc.aio.Channel, stats: SimStats,
                 noise: _Noise) -> None:
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

    async def register(self, deadline: float) -> None:
        req = pb.RegisterRequest(
            node_name=self.name, version=fedgpu.__version__,
            devices=pb.DeviceInventory(nvml_available=False, nvml_reason="simulated node"),
            decision=pb.GpuDecision(mode="none", device="cpu", gpu_index=-1,
                                    reason="simulated node: no training, no GPU"),
            labels={"simulated": "true"},
            # Its training-set size, stated as an agent does: what its updates claim below.
            num_examples=self.examples,
        )
        delay = 0.2
        while True:
            try:
                reply = await self.wire.register(req, timeout=30)
                break
            except grpc.aio.AioRpcError as exc:
                if not is_unreachable(exc) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5)
        self.node_id = reply.node_id
        self.heartbeat_s = max(1, reply.heartbeat_interval_s)
        self.max_bytes = reply.max_update_bytes or self.max_bytes

    def _note_fallback(self) -> None:
        if self.wire.bulk.error:
            self.stats.bulk_errors.append(self.wire.bulk.error)

    async def heartbeats(self) -> None:
        # Spread over the interval so a thousand nodes don't beat in the same millisecond.
        await asyncio.sleep((self.index % 97) / 97 * self.heartbeat_s)
        while True:
            try:
                await self.wire.heartbeat(
                    pb.HeartbeatRequest(node_id=self.node_id, state=self.state),
                    timeout=max(2, self.heartbeat_s))
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(self.heartbeat_s)

    async def serve(self) -> None:
        while True:
            try:
                pulled = await self.wire.pull(self.node_id, self.cfg.poll_s, self.max_bytes,
                                              self._receiver)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    return  # the aggregator is gone: the run is over for a simulation
                self.stats.errors.append(f"{self.name} pull: {exc.code().name} {exc.details()}")
                await asyncio.sleep(1)
                continue
            except PayloadError as exc:
                self.stats.errors.append(f"{self.name} pull: {exc}")
                await asyncio.sleep(1)
                continue
            finally:
                self._note_fallback()
            header = pulled.header
            if header.kind == pb.TASK_KIND_NONE:
                continue
            if header.kind == pb.TASK_KIND_SHUTDOWN:
                return
            kind = {pb.TASK_KIND_INIT: "init", pb.TASK_KIND_TRAIN: "train",
                    pb.TASK_KIND_EVALUATE: "evaluate"}.get(header.kind, "unknown")
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

    def _receiver(self, header: pb.TaskHeader) -> codec.Assembler | bulk.DigestSink:
        algo, digest = digests.of_header(header)
        if self.cfg.update_file is not None:
            return bulk.DigestSink(header.payload_size, digest, algo)
        return codec.Assembler(header.payload_size, digest, self.max_bytes, algo, DOWNLOADS)

    def _update(self, header: pb.TaskHeader, payload: memoryview | None
                ) -> dict[str, np.ndarray] | None:
        if self.cfg.update_file is not None:
            return None
        if header.kind == pb.TASK_KIND_INIT:
            return synthetic_model(self.cfg.params, self.cfg.tensors, seed=header.seed)
        if header.kind != pb.TASK_KIND_TRAIN or payload is None or header.secagg_setup:
            return None  # a secure round's change is made by simsecagg
        tensors, _ = codec.decode(payload)
        # A node-specific step along a shared direction, shrinking with the round, sent back
        # in the dtype it came in (a job's wire_dtype).
        scale = np.float32((1 + self.index % 7) / (1 + header.round))
        return {name: (g + self.noise.get(name, g.shape) * scale).astype(g.dtype, copy=False)
                for name, g in tensors.items()}

    async def _answer(self, header: pb.TaskHeader, payload: memoryview | None) -> None:
        if header.kind not in (pb.TASK_KIND_INIT, pb.TASK_KIND_TRAIN, pb.TASK_KIND_EVALUATE):
            return  # a secure round's relay after its protocol stopped: nothing to answer
        self.state = "training"
        try:
            weights = await asyncio.to_thread(self._update, header, payload)
            update = pb.UpdateHeader(
                node_id=self.node_id, task_id=header.task_id, round=header.round,
                kind=header.kind, evaluated_round=header.evaluated_round,
                num_examples=self.examples if header.kind != pb.TASK_KIND_EVALUATE else 0,
            )
            update.decision.CopyFrom(pb.GpuDecision(mode="none", device="cpu", gpu_index=-1,
                                                    reason="simulated node"))
            update.resources.CopyFrom(pb.RoundResources(
                device="cpu", nvml_used_before_mib=-1, nvml_used_peak_mib=-1,
                nvml_used_after_mib=-1, torch_peak_allocated_mib=-1,
                torch_peak_reserved_mib=-1, rss_peak_mib=-1))
            if header.kind in (pb.TASK_KIND_TRAIN, pb.TASK_KIND_EVALUATE):
                # A synthetic learning curve, so status/rounds show something that moves.
                r = header.evaluated_round
                update.eval_metrics.update({"loss": 2.3 / (1 + r), "accuracy": 1 - 0.9 / (1 + r)})
                update.num_eval_examples = 20
            if header.kind == pb.TASK_KIND_TRAIN:
                update.train_metrics.update({"loss": 2.0 / (1 + header.round)})
            if header.kind == pb.TASK_KIND_TRAIN and header.secagg_setup and payload is not None:
                from fedgpu.cli.simsecagg import answer

                await answer(self, header, payload, update)
                return
            source: codec.Encoded | Path | None = None
            if self.cfg.update_file is not None and header.kind in (pb.TASK_KIND_INIT,
                                                                    pb.TASK_KIND_TRAIN):
                size, digest = await asyncio.to_thread(file_payload, self.cfg.update_file)
                digests.stamp(update, codec.WIRE_DIGEST, digest)
                source = self.cfg.update_file
            elif weights is not None:
                source = await asyncio.to_thread(codec.encode, weights)
            started = time.perf_counter()
            try:
                reply, transport = await self.wire.push(update, source)
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


async def run_sim(cfg: SimConfig) -> SimStats:
    stats = SimStats()
    noise = _Noise()
    channels = [aio_channel(cfg.aggregator, cfg.tls)
                for _ in range(math.ceil(cfg.nodes / max(1, cfg.nodes_per_channel)))]
    nodes = [SimNode(cfg.start_index + i, cfg, channels[i // max(1, cfg.nodes_per_channel)],
                     stats, noise) for i in range(cfg.nodes)]
    started = time.perf_counter()
    deadline = time.monotonic() + cfg.connect_timeout_s
    # Bounded concurrency: a thousand simultaneous handshakes gain nothing over fifty.
    gate = asyncio.Semaphore(50)

    async def register(node: SimNode) -> None:
        async with gate:
            await node.register(deadline)

    beats: list[asyncio.Task[None]] = []
    try:
        await asyncio.gather(*(register(n) for n in nodes))
        stats.registered = len(nodes)
        stats.register_seconds = time.perf_counter() - started
        log.info("%d simulated nodes registered in %.1fs", len(nodes), stats.register_seconds)
        _write_stats(cfg, stats)
        beats = [asyncio.create_task(n.heartbeats()) for n in nodes]
        # Until the aggregator says it shuts down, or we are told to stop (SIGTERM/SIGINT):
        # a federation that stays up keeps its nodes between jobs.
        serving = asyncio.ensure_future(asyncio.gather(*(n.serve() for n in nodes)))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            stopping.cancel()
            serving.result()  # the nodes ended on their own: their error, if any, is ours
        serving.cancel()
        await asyncio.gather(serving, stopping, return_exceptions=True)
    finally:
        for t in beats:
            t.cancel()
        await asyncio.gather(*beats, return_exceptions=True)
        for ch in channels:
            await ch.close()
        _write_stats(cfg, stats)
    return stats


def _write_stats(cfg: SimConfig, stats: SimStats) -> None:
    if cfg.stats_file is not None:
        tmp = cfg.stats_file.with_name(cfg.stats_file.name + ".tmp")
        tmp.write_text(json.dumps(stats.to_dict()))
        tmp.replace(cfg.stats_file)
