"""End to end: one 256 MiB update pushed by a (simulated) node to the real aggregator, which
receives it, checks the digest, decodes, validates and folds it into FedAvg before replying.

    python -m benchmarks.wire_e2e --size-mib 256 --chunk-kib 1024
The time is the node's PushUpdate call (its own sha256 is done before, and reported apart).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import MIB, emit, spawn, start_aggregator, stop, write_job


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    params = a.size_mib * MIB // 4
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        job = write_job(tmp / "job.toml", task="synthetic", rounds=a.rounds, min_nodes=1,
                        evaluate=False, use_gpu=False, round_deadline_s=600)
        agg, address = start_aggregator(job, tmp / "agg.log", "--chunk-size",
                                        str(a.chunk_kib << 10), "--exit-when-done")
        stats = tmp / "sim.json"
        sim = spawn(["sim", "--aggregator", address, "--nodes", "1", "--params", str(params),
                     "--tensors", "8", "--poll-s", "5", "--stats", str(stats),
                     "--log-level", "WARNING"], tmp / "sim.log")
        try:
            sim.wait(timeout=600)
        finally:
            stop(sim)
            stop(agg)
        if sim.returncode != 0:
            raise RuntimeError((tmp / "sim.log").read_text()[-3000:])
        doc = json.loads(stats.read_text())
    # The first push is the init model (no aggregation yet); train pushes follow it.
    train = doc["pushes"][1:] or doc["pushes"]
    best = min(p["seconds"] for p in train)
    pull = min(p["seconds"] for p in doc["pulls"]) if doc["pulls"] else None
    size = train[0]["bytes"]
    emit({"size_mib": a.size_mib, "chunk_kib": a.chunk_kib, "push_seconds": best,
          "gb_per_s": round(size / best / 1e9, 3),
          "pull_gb_per_s": round(size / pull / 1e9, 3) if pull else None,
          "measured_at": time.time()})


if __name__ == "__main__":
    main()
