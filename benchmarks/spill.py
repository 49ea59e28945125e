"""Updates larger than the aggregator's upload memory: three 2 GiB updates under a 1 GiB budget,
spilled to disk (server/transfer/spool.py) and folded from there.

    python -m benchmarks.spill [--update-mib 2048] [--budget-mib 1024] [--nodes 3]

One FedAvg round of `fedgpu sim --update-file` nodes (the update is one safetensors file under
--dir, written once, sent by every node; the first node's copy is the initial model, round 0)
on `fedgpu server start --upload-memory-mib BUDGET --upload-spool-mib SPOOL` with the bulk port
(`--path grpc`: gRPC only). The spool holds one update at a time (SPOOL = the update's size plus
a margin), so updates are received and folded one after the other, the order the reference
below folds them in. Reported: the aggregator's resident memory read from /proc (VmRSS sampled
every 0.1 s during round 1, and VmHWM, the peak of the whole run, round 0's initial model
included) against budget + 1 model (and its RSS at start, before any weights: the
interpreter, gRPC, numpy); round 1's time, uploads and aggregation; and whether the
global model is bit-equal to the in-memory fold of the same updates (server/strategies'
WeightedSum over the file's arrays, with the examples each update carried, in the order the
round accepted them). Files are deleted afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.big_round import RssSampler, write_update
from benchmarks.common import (
    emit,
    free_port,
    proc_rss_mib,
    query,
    spawn,
    start_aggregator,
    write_job,
)
from benchmarks.common import stop as stop_proc

MIB = 1 << 20


def reference_match(update: Path, model: Path, examples: list[int]) -> str | None:
    """How the in-memory FedAvg of `update` sent once per entry of `examples` (its weight)
    matches `model` bit for bit: "in order" when folded one at a time in the round's order,
    else the first other order or grouping that does (updates that arrived together fold
    together), None when none does."""
    import itertools

    from fedgpu.core import codec
    from fedgpu.server.rounds.validation import check_finite
    from fedgpu.server.strategies.aggregate import WeightedSum

    with open(update, "rb") as fh, open(model, "rb") as gh:
        src = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        got = mmap.mmap(gh.fileno(), 0, access=mmap.ACCESS_READ)
        x = check_finite(codec.decode(src)[0])
        result = codec.decode(got)[0]
        tries: list[tuple[str, list[list[int]]]] = [("in order", [[n] for n in examples])]
        for order in itertools.permutations(examples):
            tries.append((f"one at a time, order {list(order)}", [[n] for n in order]))
            for cut in range(1, len(order)):
                tries.append((f"groups {[list(order[:cut]), list(order[cut:])]}",
                              [list(order[:cut]), list(order[cut:])]))
        for label, groups in tries:
            total = WeightedSum(x)
            for group in groups:
                total.add_many([(x, float(n)) for n in group])
            mean = total.mean()
            if mean.keys() == result.keys() and all(
                    mean[k].dtype == result[k].dtype
                    and np.array_equal(mean[k].view(np.uint8), result[k].view(np.uint8))
                    for k in mean):
                return label
            del mean, total
        # None matched: where the in-order fold differs, for the record.
        import sys

        total = WeightedSum(x)
        for n in examples:
            total.add(x, float(n))
        mean = total.mean()
        for k in sorted(mean):
            bad = np.flatnonzero(mean[k].reshape(-1) != result[k].reshape(-1))
            if bad.size:
                print(k, mean[k].size, bad.size, bad[:8], bad[-4:],
                      float(np.abs(mean[k].reshape(-1)[bad] - result[k].reshape(-1)[bad]).max()),
                      file=sys.stderr)
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--update-mib", type=int, default=2048)
    ap.add_argument("--budget-mib", type=int, default=1024)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=48)
    ap.add_argument("--path", choices=["bulk", "grpc"], default="bulk")
    ap.add_argument("--dir", default="/tmp")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fedgpu-spill-bench-", dir=a.dir))
    try:
        update = tmp / "update.safetensors"
        t0 = time.perf_counter()
        size = write_update(update, a.update_mib * MIB // 4, a.tensors)
        made_s = time.perf_counter() - t0
        model_mib = size / MIB
        spool_mib = -(-size // MIB) + 1  # one update at a time
        job = write_job(tmp / "job.toml", task="synthetic", rounds=1, min_nodes=a.nodes,
                        evaluate=False, use_gpu=False, round_deadline_s=3600)
        bulk = ["--bulk-port", str(free_port())] if a.path == "bulk" else []
        agg, address = start_aggregator(
            job, tmp / "agg.log", "--exit-when-done", "--state-dir", str(tmp / "state"),
            "--upload-memory-mib", str(a.budget_mib), "--upload-spool-mib", str(spool_mib),
            "--max-update-mib", str(spool_mib), *bulk)
        sampler = RssSampler(agg.pid, interval_s=0.1)
        # What the aggregator holds before any weights arrive (Python, gRPC, numpy).
        base_mib = proc_rss_mib(agg.pid)[0]
        sim = spawn(["sim", "--aggregator", address, "--nodes", str(a.nodes), "--poll-s", "2",
                     "--update-file", str(update), "--log-level", "WARNING"], tmp / "sim.log")
        rounds: list[dict] = []  # type: ignore[type-arg]
        hwm = 0.0
        uploads: dict = {}  # type: ignore[type-arg]
        model = tmp / "model.safetensors"
        try:
            end = time.monotonic() + 3600
            while time.monotonic() < end and agg.poll() is None:
                try:
                    st = query(address, "GetStatus")
                except Exception:  # noqa: BLE001 - exiting, or slow to answer under load
                    time.sleep(0.5)
                    continue
                hwm = max(hwm, proc_rss_mib(agg.pid)[1])
                uploads = st.get("uploads") or uploads
                if (st.get("current_round") or {}).get("round") == 1:
                    sampler.active.set()
                if st["state"] in ("finished", "failed"):
                    rounds = query(address, "ListRounds")["rounds"]
                    hwm = max(hwm, proc_rss_mib(agg.pid)[1])
                    break
                time.sleep(0.3)
            spool_left = sorted(p.name for p in (tmp / "state" / "spool").glob("*"))
            # The model once the aggregator has exited by itself (--exit-when-done): its last
            # checkpoint is written by then, not maybe still the one before.
            with contextlib.suppress(subprocess.TimeoutExpired):
                agg.wait(timeout=300)
            for found in (tmp / "state").rglob("global.safetensors"):
                shutil.copyfile(found, model)
        finally:
            sampler.close()
            stop_proc(sim)
            stop_proc(agg)
        if not rounds or not model.exists():
            raise RuntimeError(f"the round did not finish (aggregator exit {agg.returncode}):\n"
                               + (tmp / "agg.log").read_text()[-3000:]
                               + (tmp / "sim.log").read_text()[-2000:])
        (rec,) = [r for r in rounds if r["round"] == 1 and r["status"] == "finished"]
        t1 = time.perf_counter()
        match = reference_match(update, model, [u["num_examples"] for u in rec["updates"]])
        check_s = time.perf_counter() - t1
        uploads_s = sorted(u["upload_s"] for u in rec["updates"])
        limit = a.budget_mib + model_mib
        emit({
            "path": a.path, "nodes": a.nodes, "update_bytes": size,
            "update_mib": round(model_mib, 1), "budget_mib": a.budget_mib,
            "spool_mib": spool_mib, "file_write_s": round(made_s, 1),
            "round_s": rec["duration_s"], "aggregation_s": rec["aggregation_s"],
            "upload_s": uploads_s, "bytes_received": rec["bytes_received"],
            "spilled": uploads.get("spilled"), "memory_peak_bytes":
                uploads.get("memory_peak_bytes"), "spool_peak_bytes":
                uploads.get("spool_peak_bytes"), "spool_left": spool_left,
            "agg_rss_round1_peak_mib": round(sampler.peak_mib, 1),
            "agg_rss_hwm_mib": round(hwm, 1), "agg_rss_at_start_mib": round(base_mib, 1),
            "budget_plus_model_mib": round(limit, 1),
            "rss_within_budget_plus_model": hwm <= limit,
            "examples_in_order": [u["num_examples"] for u in rec["updates"]],
            "bit_equal_to_in_memory_fold": match, "reference_s": round(check_s, 1),
        })
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
