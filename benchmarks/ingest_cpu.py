"""Where an aggregator's CPU goes per byte of a bulk upload, stage by stage, against a raw socket.

    python -m benchmarks.ingest_cpu --size-mib 256 --rounds 3

A receiver process takes the same payload over loopback TCP twice per round: `raw` (recv_into
one warm buffer, nothing else: the transport benchmark's raw receiver) and `fedgpu` (what the
aggregator's bulk port runs on an upload: codec.Assembler from the upload pool, bulk.recv_payload
with the BLAKE3_SEGMENTS digest a block behind the reads, finish(), decode and the checks of
validation.decode_and_check, the FedAvg fold into a WeightedSum). Each stage is timed in wall
seconds and in CPU seconds of the whole receiving process (every thread: the digest thread's
too) and of its main thread; the sender's CPU seconds for the send alone are reported beside.

CPU seconds, unlike wall seconds, mean something on a machine shared with other work: they say
what each side costs, not how fast a loaded machine happened to run it. No gRPC, no round
engine: the aggregator's own bookkeeping around an upload is a few milliseconds a round.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common import MIB, ROOT, emit


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _Stages:
    """Wall, process CPU and main-thread CPU seconds per named stage."""

    def __init__(self) -> None:
        self.out: dict[str, dict[str, float]] = {}
        self._mark = (time.perf_counter(), _cpu(), time.thread_time())

    def lap(self, name: str) -> None:
        now = (time.perf_counter(), _cpu(), time.thread_time())
        wall, cpu, main = (b - a for a, b in zip(self._mark, now, strict=True))
        self.out[name] = {"wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                          "main_thread_cpu_s": round(main, 4)}
        self._mark = now


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError
        buf += part
    return buf


def _serve(port_file: str) -> None:
    # Imported here: the sender's process has no aggregator modules loaded.
    from fedgpu.core import bulk, codec
    from fedgpu.core.buffers import BufferPool
    from fedgpu.server.rounds.validation import decode_and_check
    from fedgpu.server.strategies.aggregate import WeightedSum

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    with open(port_file, "w") as fh:
        print(srv.getsockname()[1], file=fh, flush=True)
    pool = BufferPool(4 << 30)
    raw_buf = None
    total: WeightedSum | None = None
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                (n,) = struct.unpack(">I", _recv_exact(conn, 4))
            except EOFError:
                return
            doc = json.loads(_recv_exact(conn, n))
            stages = _Stages()
            if doc["mode"] == "raw":
                if raw_buf is None or len(raw_buf) != doc["size"]:
                    raw_buf = pool.take(doc["size"])
                view, got = memoryview(raw_buf), 0
                while got < doc["size"]:
                    got += conn.recv_into(view[got:], min(doc["size"] - got, 8 * MIB))
                view.release()
                stages.lap("receive")
            else:
                args = (doc["size"], doc["digest"], 1 << 40, codec.DigestAlgo(doc["algorithm"]),
                        pool, bytes.fromhex(doc["segments"]))
                try:  # as the aggregator's uploads do (server/transfer/uploads.py)
                    asm = codec.Assembler(*args, scan=True)
                except TypeError:  # a commit from before the scan
                    asm = codec.Assembler(*args)
                bulk.recv_payload(conn, asm, 60.0)
                stages.lap("receive")
                payload = asm.finish()
                stages.lap("finish")
                # getattr: the same script measures a commit from before the scan too.
                finite = getattr(asm, "finite", None)
                tensors = (decode_and_check(payload, None, finite()) if finite is not None
                           else decode_and_check(payload, None))
                stages.lap("decode_and_check")
                if total is None:
                    total = WeightedSum(tensors)
                total.add(tensors, 10.0)
                stages.lap("fold")
                del tensors, payload
                asm.release()
            conn.sendall(json.dumps(stages.out).encode())


def _payload(size_mib: int) -> Any:
    from fedgpu.core import codec

    rng = np.random.default_rng(0)
    n = size_mib * MIB // 4 // 8
    return codec.encode({f"t{i}": rng.standard_normal(n, dtype=np.float32) for i in range(8)})


def _push(port: int, doc: dict[str, Any], send: Callable[[socket.socket], None]
          ) -> tuple[dict[str, Any], float]:
    with socket.create_connection(("127.0.0.1", port)) as s:
        body = json.dumps(doc).encode()
        s.sendall(struct.pack(">I", len(body)) + body)
        c0 = _cpu()
        send(s)
        sent_cpu = _cpu() - c0
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while part := s.recv(1 << 16):
            reply += part
    return json.loads(reply), sent_cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        _serve(a.serve)
        return
    from fedgpu.core import bulk

    enc = _payload(a.size_mib)
    port_file = f"/tmp/ingest_cpu.{time.time_ns()}"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.ingest_cpu", "--serve",
                             port_file], cwd=ROOT)
    try:
        for _ in range(200):
            try:
                port = int(open(port_file).read())  # noqa: SIM115
                break
            except (OSError, ValueError):
                time.sleep(0.05)
        else:
            raise RuntimeError("the receiver did not start")
        runs: dict[str, list[dict[str, Any]]] = {"raw": [], "fedgpu": []}
        meta = {"size": enc.size, "digest": enc.digest, "algorithm": str(enc.algorithm),
                "segments": enc.segment_digests.hex()}
        for _ in range(a.rounds):
            for mode in ("raw", "fedgpu"):
                stages, sent = _push(port, {"mode": mode, **meta},
                                     lambda s: bulk.send_payload(s, enc.segments))
                runs[mode].append({"receiver": stages, "sender_cpu_s": round(sent, 4)})
        with socket.create_connection(("127.0.0.1", port)):
            pass  # an empty hello ends the receiver
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    emit({"size_mib": a.size_mib, "runs": runs, "measured_at": time.time()})


if __name__ == "__main__":
    main()
