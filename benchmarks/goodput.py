"""Goodput over an emulated WAN (issue 37, BENCHMARKS.md section 19): the time a real
aggregator and the node's real transfer clients (node/bulk_client.py's BulkPath on the bulk
port, node/wire_client.py's WireClient on gRPC) take to move a model through a 50 Mbit/s,
100 ms one-way, 1%-loss link (tests/net/wan_link.py), against the link's rate; with and
without a cut at half the payload (figures: benchmarks/GOODPUT.md).

    python -m benchmarks.goodput --mib 64            # ~2-3 min: both paths, both ways, cuts
    python -m benchmarks.goodput --mib 1024 --downloads-only --no-grpc-cut --no-raw  # ~10 min
    python -m benchmarks.goodput --mib 1024 --cuts-only --no-raw  # ~13 min: 4 cut transfers

Each round of the benchmark's job gives one task: the model is downloaded (one case) and an
update of the same size uploaded (one case), which closes the round for the next. Loopback, no
namespaces: the link is the emulator's relays (in this process), so no root is needed. One JSON
line per case on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from benchmarks.common import MIB, TOKEN, emit, free_port, start_aggregator, stop, write_job
from fedgpu.core import codec, digests
from fedgpu.core.transport import token_metadata
from fedgpu.node.bulk_client import BulkPath
from fedgpu.node.wire_client import WireClient
from fedgpu.proto import pb, pb_grpc
from tests.net.wan_link import WAN, Link, Way

RATE_BPS = WAN.rate_bps or 50e6


class Bench:
    def __init__(self, address: str, bulk_port: int, link: Link) -> None:
        self.address, self.bulk_port, self.link = address, bulk_port, link
        self.md = token_metadata(TOKEN)
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.FederationStub(self.channel)
        reg = self.stub.Register(pb.RegisterRequest(node_name="bench", tasks=["digits"]),
                                 metadata=self.md, timeout=30)
        self.node_id = reg.node_id
        host = "127.0.0.1"
        self.grpc_relay = link.relay("grpc", (host, 0), (host, int(address.rsplit(":", 1)[1])))
        self.bulk_relay = link.relay("bulk", (host, 0), (host, bulk_port))

    def task(self, use_bulk: bool) -> pb.TaskHeader:
        """The next training task's header (pulled directly: the control message is not what
        is measured; over gRPC the payload's chunks are skipped here and pulled again)."""
        for _ in range(60):
            for msg in self.stub.PullTask(pb.PullTaskRequest(node_id=self.node_id, wait_s=5,
                                                             bulk=use_bulk),
                                          metadata=self.md, timeout=600):
                if msg.HasField("header"):
                    if msg.header.kind == pb.TASK_KIND_TRAIN:
                        return msg.header
                    break
        raise RuntimeError("no training task offered")

    def update_header(self, task: pb.TaskHeader, enc: codec.Encoded) -> pb.UpdateHeader:
        h = pb.UpdateHeader(node_id=self.node_id, task_id=task.task_id, round=task.round,
                            kind=task.kind, num_examples=10, payload_size=enc.size)
        digests.stamp(h, codec.WIRE_DIGEST, enc.digest)
        return h

    def bulk_down(self, task: pb.TaskHeader) -> tuple[float, int]:
        path = BulkPath(f"127.0.0.1:{self.bulk_relay.address[1]}", None)
        path.reset(self.bulk_relay.address[1])
        asm = codec.Assembler(task.payload_size, task.payload_digest, 1 << 34,
                              codec.WIRE_DIGEST)
        started = time.perf_counter()
        path.download(task.bulk.ticket, self.bulk_relay.address[1], asm)
        asm.finish()
        took = time.perf_counter() - started
        asm.release()
        return took, path.resumed

    def bulk_up(self, task: pb.TaskHeader, enc: codec.Encoded) -> tuple[float, int]:
        ticket = self.stub.OpenUpload(self.update_header(task, enc), metadata=self.md,
                                      timeout=60)
        path = BulkPath(f"127.0.0.1:{self.bulk_relay.address[1]}", None)
        path.reset(self.bulk_relay.address[1])
        started = time.perf_counter()
        message = path.upload(ticket.ticket, self.bulk_relay.address[1], enc.segments)
        assert "accepted" in message, message
        return time.perf_counter() - started, path.resumed

    def grpc_down(self) -> tuple[float, int, pb.TaskHeader]:
        # Wait for the round to offer its task first (its header only, not timed), as the bulk
        # cases do: the aggregator folding the last update and opening the next round (up to
        # ~1 s on 64 MiB) is not the link's time.
        self.task(use_bulk=False)

        async def pull() -> tuple[float, int, pb.TaskHeader]:
            client = WireClient(f"127.0.0.1:{self.grpc_relay.address[1]}", TOKEN)
            try:
                for _ in range(60):
                    started = time.perf_counter()
                    pulled = await client.pull(self.node_id, 5, 1 << 34)
                    took = time.perf_counter() - started
                    if pulled.receiver is not None:
                        pulled.receiver.release()  # type: ignore[union-attr]
                    # No task yet (the last round's 1 GB update is still being folded): the
                    # long poll came back empty; ask again.
                    if pulled.payload is not None:
                        assert pulled.transport == "grpc"
                        return took, client.resumed, pulled.header
                raise RuntimeError("no task with a payload offered")
            finally:
                await client.close()
        return asyncio.run(pull())

    def grpc_up(self, task: pb.TaskHeader, enc: codec.Encoded) -> tuple[float, int]:
        async def push() -> tuple[float, int]:
            client = WireClient(f"127.0.0.1:{self.grpc_relay.address[1]}", TOKEN)
            try:
                started = time.perf_counter()
                reply, path = await client.push(self.update_header(task, enc), enc)
                assert reply.accepted and path == "grpc", reply
                return time.perf_counter() - started, client.resumed
            finally:
                await client.close()
        return asyncio.run(push())


def raw_baseline(size: int) -> dict[str, Any]:
    """The same bytes through the same emulated link between two plain sockets: the rate the
    emulator itself reaches on this machine now (its pacing is Python threads: on a loaded
    machine it can fall short of the nominal rate)."""
    server = socket.create_server(("127.0.0.1", 0))
    got: list[int] = []

    def sink() -> None:
        conn, _ = server.accept()
        n = 0
        with conn:
            while data := conn.recv(1 << 20):
                n += len(data)
            got.append(n)
            conn.sendall(b"k")

    threading.Thread(target=sink, daemon=True).start()
    link = Link(WAN, seed=1)
    try:
        relay = link.relay("raw", ("127.0.0.1", 0), server.getsockname())
        block = memoryview(bytes(1 << 20))
        started = time.perf_counter()
        with socket.create_connection(relay.address, timeout=60) as s:
            for offset in range(0, size, len(block)):
                s.sendall(block[: min(len(block), size - offset)])
            s.shutdown(socket.SHUT_WR)
            assert s.recv(1) == b"k"
        took = time.perf_counter() - started
    finally:
        link.close()
        server.close()
    assert got == [size]
    return _case("raw_socket", size, took, 0, size, size, False)


def _case(name: str, size: int, took: float, resumed: int, sent: int, delivered: int,
          cut: bool) -> dict[str, Any]:
    """One transfer's figures. Sent twice: bytes that entered the link beyond the payload
    (with a cut, what was in flight inside the link at the cut, up to a bandwidth-delay
    product and the loss stalls, is sent again by any protocol). Delivered twice: bytes the
    receiver got beyond the payload (what a resume that restarts would add)."""
    goodput = size * 8 / took
    return {"case": name, "payload_mib": round(size / MIB, 1), "cut_at_half": cut,
            "seconds": round(took, 2), "goodput_mbit_s": round(goodput / 1e6, 2),
            "of_link_rate": round(goodput / RATE_BPS, 3), "resumed": resumed,
            "sent_twice_share": round(max(0, sent - size) / size, 4),
            "delivered_twice_share": round(max(0, delivered - size) / size, 4)}


def run(mib: int, downloads_only: bool, grpc_cut: bool, raw: bool, only: list[str],
        tmp: Path, cuts_only: bool = False) -> None:
    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal(mib * MIB // 4, dtype=np.float32)}
    enc = codec.encode(model)
    init = tmp / "init.safetensors"
    init.write_bytes(enc.to_bytes())
    update = codec.encode({"w": model["w"] + 1.0})
    del model
    job = write_job(tmp / "job.toml", task="digits", rounds=50, min_nodes=1, fraction=1.0,
                    round_deadline_s=3600, use_gpu=False, evaluate=False, round_retries=5,
                    initial_weights=str(init))
    bulk_port = free_port()
    proc, address = start_aggregator(job, tmp / "aggregator.log", "--bulk-port",
                                     str(bulk_port), "--upload-idle-s", "120",
                                     "--max-update-mib", str(2 * mib + 64))
    if raw:
        emit({"way": "up", **raw_baseline(enc.size)})
    link = Link(WAN, seed=mib)
    try:
        bench = Bench(address, bulk_port, link)
        cases = [c for c in [("bulk", False), ("bulk", True), ("grpc", False), ("grpc", True)]
                 if c[0] in only and (grpc_cut or c != ("grpc", True))
                 and (c[1] or not cuts_only)]
        for transport, cut in cases:
            for way in (Way.DOWN,) if downloads_only else (Way.DOWN, Way.UP):
                label = transport
                before = link.total(label, way)
                conns = len(link.history)
                if cut:
                    # Half the payload into this direction's next connection on that port
                    # (gRPC: its HTTP/2 set-up and header come first, a few kB).
                    link.cut(label, way, enc.size // 2)
                if way is Way.DOWN and transport == "bulk":
                    task = bench.task(use_bulk=True)
                    took, resumed = bench.bulk_down(task)
                    size = task.payload_size
                elif way is Way.DOWN:
                    took, resumed, task = bench.grpc_down()
                    size = task.payload_size
                elif transport == "bulk":
                    took, resumed = bench.bulk_up(task, update)
                    size = update.size
                else:
                    took, resumed = bench.grpc_up(task, update)
                    size = update.size
                delivered = sum(c.delivered[way] for c in link.history[conns:]
                                if c.port == label)
                emit({"way": str(way), **_case(transport, size, took, resumed,
                                               link.total(label, way) - before, delivered,
                                               cut)})
            if downloads_only:
                # Close the round for the next case (an upload straight to the aggregator,
                # not through the link: not measured).
                path = BulkPath(f"127.0.0.1:{bulk_port}", None)
                path.reset(bulk_port)
                ticket = bench.stub.OpenUpload(bench.update_header(task, update),
                                               metadata=bench.md, timeout=60)
                path.upload(ticket.ticket, bulk_port, update.segments)
    finally:
        link.close()
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="model size in MiB")
    ap.add_argument("--downloads-only", action="store_true",
                    help="measure downloads only (the 1 GB run: ~170 s per transfer)")
    ap.add_argument("--no-grpc-cut", dest="grpc_cut", action="store_false",
                    help="skip the gRPC case with a cut")
    ap.add_argument("--cuts-only", action="store_true",
                    help="only the cases with a cut (the 1 GB run: ~3 min per transfer)")
    ap.add_argument("--no-raw", dest="raw", action="store_false",
                    help="skip the plain-socket baseline through the same link")
    ap.add_argument("--only", nargs="+", default=["bulk", "grpc"], choices=["bulk", "grpc"],
                    help="the paths to measure")
    args = ap.parse_args()
    emit({"machine": os.uname().nodename, "cpus": os.cpu_count(),
          "load_1m": round(os.getloadavg()[0], 2), "mib": args.mib,
          "link": {"delay_s": WAN.delay_s, "jitter_s": WAN.jitter_s, "loss": WAN.loss,
                   "rate_bps": WAN.rate_bps}})
    with tempfile.TemporaryDirectory(prefix="fedgpu-goodput-") as tmp:
        run(args.mib, args.downloads_only, args.grpc_cut, args.raw, args.only, Path(tmp),
            args.cuts_only)
    emit({"load_1m_after": round(os.getloadavg()[0], 2)})


if __name__ == "__main__":
    main()
