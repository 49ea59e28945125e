"""Simulated nodes live as agents do: they wait out an aggregator restart and come back, and a
node whose task loop ended stops heartbeating (the aggregator must not count it alive and
sample it for rounds it will never answer)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections import Counter
from concurrent import futures
from pathlib import Path

import grpc

from fedgpu.node.sim.records import SimConfig
from fedgpu.node.sim.run import run_sim
from fedgpu.proto import pb, pb_grpc
from tests.fixtures.federation import Federation, cli, write_job


def _alive(federation: Federation) -> set[str]:
    return {n["name"] for n in federation.query("ListNodes")["nodes"] if n["alive"]}


def _wait_alive(federation: Federation, names: set[str], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if names <= _alive(federation):
                return
        except Exception:  # noqa: BLE001 - the aggregator is still coming up
            pass
        time.sleep(0.3)
    raise AssertionError(f"never alive: {sorted(names - _alive(federation))}\n"
                         + "\n".join(p.text()[-1500:] for p in federation.procs))


def test_simulated_nodes_come_back_after_an_aggregator_restart(
        federation: Federation, tmp_path: Path) -> None:
    federation.start_server(None, "--heartbeat-s", "1")
    stats = tmp_path / "sim.json"
    sim = federation.spawn("sim", ["sim", "--aggregator", federation.address, "--nodes", "6",
                                   "--poll-s", "2", "--params", "100", "--tensors", "2",
                                   "--stats", str(stats)])
    names = {f"sim-{i:05d}" for i in range(6)}
    _wait_alive(federation, names)
    for _ in range(2):
        # A crash (SIGKILL: no goodbye of any kind), then the same aggregator again.
        server = next(p for p in federation.procs if p.name == "aggregator")
        server.popen.send_signal(signal.SIGKILL)
        server.popen.wait(timeout=30)
        time.sleep(1.5)  # long enough for every node's poll to fail at least once
        assert sim.popen.poll() is None, sim.text()[-3000:]
        federation.restart_server()
        _wait_alive(federation, names)
    # Alive is not enough (heartbeats alone did that before): every node's task loop must
    # still poll, so a job that needs all six of them runs to its end.
    job = write_job(tmp_path / "job.toml", task="synthetic", hyperparameters={}, rounds=2,
                    min_nodes=6, min_available_nodes=6, evaluate=False)
    r = cli("job", "submit", str(job), "--address", federation.address)
    assert r.returncode == 0, r.stderr
    assert federation.wait_state(("finished", "failed"), timeout=90)["state"] == "finished"
    sim.popen.send_signal(signal.SIGTERM)
    assert sim.popen.wait(timeout=60) == 0, sim.text()[-3000:]
    doc = json.loads(stats.read_text())
    assert doc["registered"] == 6 and doc["errors"] == [], doc
    assert doc["tasks"]["train"] == 12 and doc["ended"] == 0  # all stopped by SIGTERM
    # Every node's poll failed and was tried again (two outages close together may count
    # as one for a node whose first poll after the outage was still open).
    assert doc["reconnects"] >= 6, doc


class _Aggregator(pb_grpc.FederationServicer):
    """A real gRPC Federation endpoint that ends one node's task loop ("the run is over")
    and keeps the other polling; it counts every heartbeat by node."""

    def __init__(self, ended: str) -> None:
        self.ended = ended
        self.beats: Counter[str] = Counter()
        self.lock = threading.Lock()

    def Register(self, request, context):  # noqa: N802
        return pb.RegisterReply(node_id=request.node_name, heartbeat_interval_s=1)

    def Heartbeat(self, request, context):  # noqa: N802
        with self.lock:
            self.beats[request.node_id] += 1
        return pb.HeartbeatReply(known=True)

    def PullTask(self, request, context):  # noqa: N802
        if request.node_id == self.ended:
            yield pb.TaskChunk(header=pb.TaskHeader(kind=pb.TASK_KIND_SHUTDOWN, message="over"))
            return
        time.sleep(0.3)
        yield pb.TaskChunk(header=pb.TaskHeader(kind=pb.TASK_KIND_NONE))

    def counts(self) -> Counter[str]:
        with self.lock:
            return Counter(self.beats)


def test_a_node_whose_task_loop_ended_stops_heartbeating() -> None:
    servicer = _Aggregator(ended="sim-00000")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_FederationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    cfg = SimConfig(aggregator=f"127.0.0.1:{port}", token=None, nodes=2, poll_s=1,
                    params=10, tensors=1)

    async def go() -> tuple[Counter[str], Counter[str], int]:
        stop = asyncio.Event()
        task = asyncio.create_task(run_sim(cfg, stop))
        await asyncio.sleep(3.5)
        first = servicer.counts()
        await asyncio.sleep(3)
        second = servicer.counts()
        stop.set()
        stats = await task
        return first, second, stats.ended
    try:
        first, second, ended = asyncio.run(go())
    finally:
        server.stop(0)
    # The node told the run is over beat at most once before its loop ended, then never;
    # the other one kept beating every second.
    assert first["sim-00000"] <= 1 and second["sim-00000"] == first["sim-00000"]
    assert second["sim-00001"] >= first["sim-00001"] + 2
    assert ended == 1
