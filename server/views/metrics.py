"""Prometheus metrics of the aggregator, served over plain HTTP (`--metrics-port`).

Every value is read from the orchestrator and the registry when scraped, so nothing in the
round logic has to remember to count. The HTTP endpoint runs on the aggregator's own event
loop (not prometheus_client's server thread): a scrape then never sees a round half-way
through an update, and no lock is needed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

import fedgpu
from fedgpu.core.constants import RUN_STATES, RoundStatus
from fedgpu.core.errors import FedgpuError
from fedgpu.proto import pb
from fedgpu.server.jobs.queue import JobManager
from fedgpu.server.rounds import device_time
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.records import RoundRecord
from fedgpu.server.views import privacy

log = logging.getLogger("fedgpu.server.views.metrics")

_MAX_REQUEST = 8192
# The classic text format every Prometheus (2.x and 3.x) scrapes; our names are plain ASCII,
# so generate_latest's output is valid 0.0.4 whatever version the library calls "latest".
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Totals:
    """Running sums over the round history; a record's counted fields never change once
    it is appended, so only new records are added up on each scrape. They restart with each
    job (a counter reset, which Prometheus' rate() handles)."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.seen = 0
        self.sums = {"finished": 0, "retried": 0, "updates": 0, "failures": 0, "bytes": 0,
                     "aggregation_s": 0.0, "duration_s": 0.0}

    def update(self, run_id: str, history: list[RoundRecord]) -> dict[str, float]:
        if len(history) < self.seen or run_id != self.run_id:  # another job, or a resume
            self.__init__()  # type: ignore[misc]
            self.run_id = run_id
        for rec in history[self.seen:]:
            s = self.sums
            s["finished" if rec.status == RoundStatus.FINISHED else "retried"] += 1
            s["updates"] += len(rec.updates)
            s["failures"] += len(rec.failures)
            s["bytes"] += int(rec.bytes_received or 0)
            s["aggregation_s"] += float(rec.aggregation_s or 0.0)
            s["duration_s"] += float(rec.duration_s or 0.0)
        self.seen = len(history)
        return dict(self.sums)


class FederationCollector:
    def __init__(self, jobs: JobManager) -> None:
        self.jobs = jobs
        self.registry = jobs.registry
        self.totals = _Totals()

    def collect(self) -> Iterator[Metric]:
        held = self.jobs.active or self.jobs.last
        if held is not None:
            yield from self._run(held.orch)
            yield _device_seconds(held.row.job_id, held.orch)
        yield from self._nodes()

    def _run(self, orch: Orchestrator) -> Iterator[Metric]:
        """The current job's run (or the one that ended last)."""
        job = orch.job
        sums = self.totals.update(orch.run_id, orch.history.records)
        # The open round's accepted updates and bytes count as soon as they arrive.
        cur = orch.current
        open_updates = (len(cur.updates) if cur is not None and cur.kind == pb.TASK_KIND_TRAIN
                        else 0)
        open_bytes = cur.bytes_received if cur is not None else 0

        info = GaugeMetricFamily("fedgpu_info", "The run this aggregator serves.",
                                 labels=["run_id", "task", "mode", "strategy", "version"])
        info.add_metric([orch.run_id, job.task, job.mode, job.strategy, fedgpu.__version__], 1)
        yield info
        state = GaugeMetricFamily("fedgpu_run_state", "1 for the run's current state.",
                                  labels=["state"])
        for name in RUN_STATES:
            state.add_metric([name], 1.0 if orch.state == name else 0.0)
        yield state
        yield GaugeMetricFamily("fedgpu_round", "Last finished round.", value=orch.global_round)
        yield GaugeMetricFamily("fedgpu_rounds_planned", "Rounds the job asks for.",
                                value=job.rounds)
        attempts = CounterMetricFamily("fedgpu_round_attempts", "Closed training round "
                                       "attempts by outcome (retried: too few updates).",
                                       labels=["status"])
        attempts.add_metric(["finished"], sums["finished"])
        attempts.add_metric(["retried"], sums["retried"])
        yield attempts
        yield CounterMetricFamily("fedgpu_rounds", "Training rounds finished.",
                                  value=sums["finished"])
        yield CounterMetricFamily("fedgpu_updates_accepted", "Training updates accepted.",
                                  value=sums["updates"] + open_updates)
        rejected = CounterMetricFamily("fedgpu_updates_rejected", "Updates refused, by reason.",
                                       labels=["reason"])
        for reason, count in sorted(dict(orch.rejections).items()):
            rejected.add_metric([reason], count)
        yield rejected
        yield CounterMetricFamily("fedgpu_update_failures", "Rounds a node reported as failed "
                                  "(e.g. CUDA out of memory).", value=sums["failures"])
        yield CounterMetricFamily("fedgpu_received_bytes", "Update payload bytes accepted.",
                                  value=sums["bytes"] + open_bytes)
        yield CounterMetricFamily("fedgpu_aggregation_seconds", "Seconds the strategy spent "
                                  "aggregating (streaming adds and the round's finish).",
                                  value=sums["aggregation_s"])
        yield CounterMetricFamily("fedgpu_round_seconds", "Wall-clock seconds of closed "
                                  "training rounds.", value=sums["duration_s"])
        last = orch.history.records[-1] if orch.history.records else None
        if last is not None:
            yield GaugeMetricFamily("fedgpu_last_round_duration_seconds", "The last closed "
                                    "round's duration.", value=last.duration_s or 0.0)
            yield GaugeMetricFamily("fedgpu_last_round_aggregation_seconds", "The last closed "
                                    "round's aggregation time.",
                                    value=last.aggregation_s or 0.0)
        yield from _privacy(orch)
        latest = orch.history.latest_eval()
        for metric in ("accuracy", "loss"):
            value = None if latest is None else getattr(latest, metric)
            if value is not None:
                yield GaugeMetricFamily(f"fedgpu_eval_{metric}", f"Latest federated evaluation "
                                        f"{metric} of the global model.", value=value)

    def _nodes(self) -> Iterator[Metric]:
        snap = self.registry.snapshot()
        yield GaugeMetricFamily("fedgpu_nodes_registered", "Nodes registered.", value=len(snap))
        yield GaugeMetricFamily("fedgpu_nodes_alive", "Nodes heard from within three "
                                "heartbeats.", value=sum(1 for n in snap if n["alive"]))
        up = GaugeMetricFamily("fedgpu_node_up", "1 while the node is alive.", labels=["node"])
        seen = GaugeMetricFamily("fedgpu_node_last_seen_seconds", "Seconds since the node was "
                                 "last heard from.", labels=["node"])
        done = CounterMetricFamily("fedgpu_node_rounds_completed", "Training rounds the node "
                                   "completed.", labels=["node"])
        gpu = GaugeMetricFamily("fedgpu_node_uses_gpu", "1 when the node's GPU decision is a "
                                "GPU.", labels=["node"])
        mem = GaugeMetricFamily("fedgpu_node_gpu_memory_used_mib", "NVML memory used on the "
                                "node's GPU in its last round, before / peak / after.",
                                labels=["node", "stage"])
        rss = GaugeMetricFamily("fedgpu_node_rss_peak_mib", "Peak RSS of the node's training "
                                "process in its last round.", labels=["node"])
        for n in snap:
            name = n["name"]
            up.add_metric([name], 1.0 if n["alive"] else 0.0)
            seen.add_metric([name], n["last_seen_s"])
            done.add_metric([name], n["rounds_completed"])
            gpu.add_metric([name], 1.0 if (n["gpu_decision"] or {}).get("use_gpu") else 0.0)
            res = n["last_resources"] or {}
            for stage in ("before", "peak", "after"):
                value = res.get(f"nvml_used_{stage}_mib")
                if value is not None:
                    mem.add_metric([name, stage], value)
            if res.get("rss_peak_mib") is not None:
                rss.add_metric([name], res["rss_peak_mib"])
        yield from (up, seen, done, gpu, mem, rss)


def make_registry(jobs: JobManager) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FederationCollector(jobs))  # type: ignore[arg-type]
    # The aggregator process itself: resident memory, CPU seconds, open files.
    ProcessCollector(registry=reg)
    return reg


class MetricsServer:
    """GET /metrics on the event loop; anything else is 404."""

    def __init__(self, reg: CollectorRegistry) -> None:
        self.reg = reg
        self.server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> None:
        try:
            self.server = await asyncio.start_server(self._handle, host, port)
        except OSError as exc:
            raise FedgpuError(f"cannot serve metrics on {host}:{port}: {exc.strerror}; is the "
                              "port in use? pick another --metrics-port (0 turns it off)"
                              ) from None
        log.info("Prometheus metrics on http://%s:%d/metrics", host, port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            parts = head[:_MAX_REQUEST].split(b"\r\n", 1)[0].split()
            method, path = (parts + [b"", b""])[:2]
            if method not in (b"GET", b"HEAD") or path.split(b"?")[0] != b"/metrics":
                status, ctype, body = "404 Not Found", "text/plain", b"try /metrics\n"
            else:
                status, ctype, body = "200 OK", CONTENT_TYPE, generate_latest(self.reg)
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: "
                         f"{len(body)}\r\nConnection: close\r\n\r\n".encode())
            if method != b"HEAD":
                writer.write(body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def serve_metrics(jobs: JobManager, host: str,
                        port: int) -> MetricsServer:
    server = MetricsServer(make_registry(jobs))
    await server.start(host, port)
    return server


def _privacy(orch: Orchestrator) -> Iterator[Metric]:
    """A job with [privacy]: the epsilon spent so far and the budget (server/views/privacy.py)."""
    if orch.job.privacy is None:
        return
    doc = privacy.summary(orch.job.to_dict(), orch.history.dicts())
    assert doc is not None
    yield GaugeMetricFamily("fedgpu_privacy_epsilon_spent", "Epsilon the job's rounds spent "
                            "(at the job's delta); +Inf without noise.",
                            value=_inf_if_none(doc["epsilon_spent"]))
    if doc["target_epsilon"] is not None:
        yield GaugeMetricFamily("fedgpu_privacy_epsilon_target", "The job's privacy budget.",
                                value=doc["target_epsilon"])
    yield GaugeMetricFamily("fedgpu_privacy_delta", "The job's delta.", value=doc["delta"])


def _inf_if_none(value: float | None) -> float:
    # A stored infinity reads back as null (strict JSON): no noise, no bound.
    return float("inf") if value is None else float(value)


def _device_seconds(job_id: str, orch: Orchestrator) -> Metric:
    """GPU-hours: device-seconds of training per site of the job (server/rounds/device_time.py);
    a data-parallel round counts every worker's device."""
    family = CounterMetricFamily("fedgpu_device_seconds", "Device-seconds of training (each "
                                 "device of a data-parallel round counted), per site and job.",
                                 labels=["job_id", "site"])
    for site, seconds in device_time.per_site_records(orch.history.records).items():
        family.add_metric([job_id, site], seconds)
    return family
