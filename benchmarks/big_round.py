"""A "GPT-2 Large" round: 6 simulated nodes each upload a 3.4 GB float32 update into one
FedAvg round on one aggregator, over the bulk port or over gRPC only.

    python -m benchmarks.big_round --path bulk|grpc [--params 850000000] [--nodes 6]

The update is one safetensors file under /tmp, written once and memory-mapped: every node
sends it from disk (`fedgpu sim --update-file`), so the machine holds it once in its page
cache. The first node's copy is the initial model (round 0); round 1 is the measured one:
every node downloads the global model (checked against its digest, then dropped) and
uploads its update, which the aggregator receives, checks, validates and folds into FedAvg.
Reported: round 1's wall time (`fedgpu rounds` duration_s), its uploads and aggregation,
and the aggregator's resident memory, sampled every 0.2 s during round 1 and its peak over
the whole run (VmHWM: the round-0 initial model included). Files are deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (
    emit,
    free_port,
    proc_rss_mib,
    query,
    spawn,
    start_aggregator,
    stop,
    write_job,
)

GB = 1e9


def write_update(path: Path, params: int, tensors: int) -> int:
    """A safetensors file of `tensors` float32 tensors, written tensor by tensor (never the
    whole model in memory). Its size in bytes."""
    each = params // tensors
    sizes = [each] * (tensors - 1) + [params - each * (tensors - 1)]
    header: dict[str, object] = {}
    offset = 0
    for i, n in enumerate(sizes):
        header[f"h{i:02d}.weight"] = {"dtype": "F32", "shape": [n],
                                       "data_offsets": [offset, offset + 4 * n]}
        offset += 4 * n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    rng = np.random.default_rng(0)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)) + head)
        for n in sizes:
            fh.write((rng.random(n, dtype=np.float32) - 0.5).tobytes())
    return path.stat().st_size


class RssSampler:
    """The aggregator's resident memory every `interval_s`, while `active` is set."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.active = threading.Event()
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.active.is_set():
                try:
                    self.peak_mib = max(self.peak_mib, proc_rss_mib(self.pid)[0])
                except (OSError, ValueError):
                    return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", choices=["bulk", "grpc"], default="bulk")
    ap.add_argument("--params", type=int, default=850_000_000)  # 3.4 GB of float32
    ap.add_argument("--tensors", type=int, default=48)
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--dir", default="/tmp")
    # 0: the aggregator's default (4 GiB: one 3.4 GB update at a time). A smaller model with
    # room for one update at a time shows the same memory multiple in a fraction of the time.
    ap.add_argument("--upload-memory-mib", type=int, default=0)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fedgpu-biground-", dir=a.dir))
    try:
        update = tmp / "update.safetensors"
        t0 = time.perf_counter()
        size = write_update(update, a.params, a.tensors)
        made_s = time.perf_counter() - t0
        job = write_job(tmp / "job.toml", task="synthetic", rounds=1, min_nodes=a.nodes,
                        evaluate=False, use_gpu=False, round_deadline_s=3600)
        bulk = ["--bulk-port", str(free_port())] if a.path == "bulk" else []
        agg, address = start_aggregator(job, tmp / "agg.log", "--exit-when-done",
                                        "--state-dir", str(tmp / "state"), *bulk,
                                        *(["--upload-memory-mib", str(a.upload_memory_mib)]
                                          if a.upload_memory_mib else []))
        sampler = RssSampler(agg.pid)
        sim = spawn(["sim", "--aggregator", address, "--nodes", str(a.nodes), "--poll-s", "2",
                     "--update-file", str(update), "--stats", str(tmp / "sim.json"),
                     "--log-level", "WARNING"], tmp / "sim.log")
        rounds: list[dict] = []  # type: ignore[type-arg]
        hwm = 0.0
        try:
            end = time.monotonic() + 3600
            while time.monotonic() < end and agg.poll() is None:
                try:
                    st = query(address, "GetStatus")
                except Exception:  # noqa: BLE001 - the aggregator is exiting
                    break
                hwm = max(hwm, proc_rss_mib(agg.pid)[1])
                cur = st.get("current_round") or {}
                if cur.get("round") == 1:
                    sampler.active.set()
                if st["state"] in ("finished", "failed"):
                    rounds = query(address, "ListRounds")["rounds"]
                    break
                time.sleep(0.5)
        finally:
            sampler.close()
            stop(sim)
            stop(agg)
        if not rounds:
            raise RuntimeError("the round did not finish:\n"
                               + (tmp / "agg.log").read_text()[-3000:]
                               + (tmp / "sim.log").read_text()[-2000:])
        (rec,) = [r for r in rounds if r["round"] == 1 and r["status"] == "finished"]
        uploads = sorted(u["upload_s"] for u in rec["updates"])
        stats = json.loads((tmp / "sim.json").read_text())
        pulls = [p for p in stats["pulls"]]
        emit({
            "path": a.path, "nodes": a.nodes, "params": a.params, "update_bytes": size,
            "update_gb": round(size / GB, 3), "file_write_s": round(made_s, 1),
            "round_s": rec["duration_s"], "aggregation_s": rec["aggregation_s"],
            "upload_s_min": uploads[0], "upload_s_max": uploads[-1],
            "upload_s_median": uploads[len(uploads) // 2],
            "transport": sorted({u.get("transport", "grpc") for u in rec["updates"]}),
            "download_s_max": max((p["seconds"] for p in pulls), default=None),
            "bytes_received": rec["bytes_received"],
            "agg_rss_round_peak_mib": round(sampler.peak_mib, 1),
            "agg_rss_hwm_mib": round(hwm, 1),
            "sim_errors": len(stats["errors"]),
        })
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
