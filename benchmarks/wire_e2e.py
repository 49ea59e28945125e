"""End to end: one 256 MiB update pushed by a (simulated) node to the real aggregator, which
receives it, checks the digest, decodes, validates and folds it into FedAvg before replying.

    python -m benchmarks.wire_e2e --size-mib 256 [--chunk-kib 1024] [--path grpc|bulk] [--tls]
The push time is the node's whole upload (the ticket call too, on the bulk path; the node's own
digest is computed before, at encode, as a real node's worker does). The pull time is the
node's download of the global model, header to verified last byte. `--path grpc` runs the
aggregator without a bulk port; `--tls` runs both ports with mutual TLS (certificates made
for the run).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import MIB, emit, free_port, spawn, start_aggregator, stop, write_job
from fedgpu.cli.report.plots import load_state_dir


def _certs(tmp: Path) -> tuple[list[str], list[str], object]:
    from fedgpu.core import certs
    from fedgpu.core.tls import TlsFiles

    certs.init_ca(tmp / "certs")
    certs.issue_server(tmp / "certs", sans=["localhost", "127.0.0.1"])
    node = certs.issue_node(tmp / "certs", "sim-00000")
    srv = tmp / "certs" / "server"
    server = ["--tls-cert", str(srv / "server.crt"), "--tls-key", str(srv / "server.key"),
              "--tls-ca", str(srv / "ca.crt")]
    client = ["--tls-cert", str(node.cert), "--tls-key", str(node.key), "--tls-ca", str(node.ca)]
    # Health checks from this process present the node's certificate (any client cert the CA
    # signed may ask for health).
    return server, client, TlsFiles(node.cert, node.key, node.ca)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--path", choices=["grpc", "bulk"], default="grpc")
    ap.add_argument("--tls", action="store_true")
    a = ap.parse_args()
    params = a.size_mib * MIB // 4
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        job = write_job(tmp / "job.toml", task="synthetic", rounds=a.rounds, min_nodes=1,
                        evaluate=False, use_gpu=False, round_deadline_s=600)
        server_tls: list[str] = []
        client_tls: list[str] = []
        admin_tls = None
        if a.tls:
            server_tls, client_tls, admin_tls = _certs(tmp)
        bulk = ["--bulk-port", str(free_port())] if a.path == "bulk" else []
        agg, address = start_aggregator(job, tmp / "agg.log", "--chunk-size",
                                        str(a.chunk_kib << 10), "--exit-when-done", *bulk,
                                        "--state-dir", str(tmp / "state"), *server_tls,
                                        tls=admin_tls)
        stats = tmp / "sim.json"
        sim = spawn(["sim", "--aggregator", address, "--nodes", "1", "--params", str(params),
                     "--tensors", "8", "--poll-s", "5", "--stats", str(stats),
                     "--log-level", "WARNING", *client_tls], tmp / "sim.log")
        try:
            sim.wait(timeout=600)
        finally:
            stop(sim)
            stop(agg)
        if sim.returncode != 0:
            raise RuntimeError((tmp / "sim.log").read_text()[-3000:])
        doc = json.loads(stats.read_text())
        # The aggregator's side of each training update, from the job's checkpointed history:
        # first to last byte received, and the accumulate step (decode and validation, a few
        # ms, fall between the two and are counted in neither).
        history = load_state_dir(tmp / "state").rounds  # the job database's copy
        ingest = [(u["upload_s"], h["aggregation_s"]) for h in history
                  if h["round"] >= 1 and h["status"] == "finished"
                  for u in h["updates"] if u.get("upload_s")]
    # The first push is the init model (no aggregation yet); train pushes follow it.
    train = doc["pushes"][1:] or doc["pushes"]
    best = min(p["seconds"] for p in train)
    pull = min(p["seconds"] for p in doc["pulls"]) if doc["pulls"] else None
    size = train[0]["bytes"]
    emit({"size_mib": a.size_mib, "chunk_kib": a.chunk_kib, "path": a.path, "tls": a.tls,
          "transport": sorted({p.get("transport", "grpc") for p in train}),
          "push_seconds": best, "gb_per_s": round(size / best / 1e9, 3),
          "pull_gb_per_s": round(size / pull / 1e9, 3) if pull else None,
          # Best round: receive (with the digest as bytes land) + accumulate, aggregator side.
          "ingest_seconds": min((r + g for r, g in ingest), default=None),
          "ingest_gb_per_s": (round(size / min(r + g for r, g in ingest) / 1e9, 3)
                              if ingest else None),
          # Of the best round: receiving (digest as the bytes land) and the fold after it.
          "ingest_split_s": (list(min(ingest, key=sum)) if ingest else None),
          "measured_at": time.time()})


if __name__ == "__main__":
    main()
