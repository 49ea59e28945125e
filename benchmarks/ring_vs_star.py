"""Ring (D-PSGD gossip) vs star (everything through one hub): bytes and time per iteration.

`python -m benchmarks.ring_vs_star [--max-nodes 8 --iterations 30]` writes benchmarks/RING.md.

Both topologies run the digits CNN on real gloo processes on loopback, one process per worker,
one gradient step of batch 32 per iteration:
- ring: node/gossip.py's exchange with the uniform ring (left, self, right), as ring mode runs;
- star: every worker sends its copy to a hub process, which averages and sends the average back
  to each — the communication pattern of synchronous FedAvg with one step per round, on the same
  transport, so only the topology differs. (fedgpu's star mode moves models over gRPC once per
  round of whole epochs; its wire costs are in BENCHMARKS.md.)
Bytes are counted from the tensors handed to the transport: the payload, not TCP framing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, free_port

OUT_MD = ROOT / "benchmarks" / "RING.md"
WARMUP = 5


def worker(rank: int, world: int, port: int, mode: str, iterations: int, out: Path) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fedgpu.core.mixing import uniform_ring
    from fedgpu.node import gossip
    from fedgpu.node.tasks.digits import DigitsTask

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    timeout = datetime.timedelta(seconds=120)
    store = gossip.store_of("127.0.0.1", port, world, rank, 120)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world, timeout=timeout)
    task = DigitsTask()
    model = task.build_model({})
    opt = task.optimizer(model, {})
    x = torch.randn(360, 1, 8, 8)
    y = torch.randint(0, 10, (360,))
    shared = [t for t in model.state_dict().values() if t.is_floating_point()]
    workers = world - 1 if mode == "star" else world
    hub = world - 1
    ring = gossip.Ring(rank, uniform_ring(world), 120, [str(r) for r in range(world)]) \
        if mode == "ring" else None
    sent = 0
    times: list[float] = []
    for k in range(WARMUP + iterations):
        start = time.perf_counter()
        if mode == "star" and rank == hub:
            bufs = [torch.empty(sum(t.numel() for t in shared)) for _ in range(workers)]
            for w in [dist.irecv(b, r) for r, b in enumerate(bufs)]:
                w.wait()
            avg = torch.stack(bufs).mean(0)
            for w in [dist.isend(avg, r) for r in range(workers)]:
                w.wait()
            step_sent = avg.numel() * 4 * workers
        else:
            idx = torch.randint(0, 360, (32,))
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            flat = gossip.flat_params(shared)
            if ring is not None:
                before = ring.bytes_sent
                ring.mix_(flat)
                step_sent = ring.bytes_sent - before
            else:
                dist.isend(flat, hub).wait()
                dist.irecv(flat, hub).wait()
                step_sent = flat.numel() * 4
            gossip.unflatten_(flat, shared)
            opt.step()
        if k >= WARMUP:
            times.append(time.perf_counter() - start)
            sent += step_sent
    dist.barrier()
    (out / f"{mode}-{world}-{rank}.json").write_text(json.dumps({
        "rank": rank, "hub": mode == "star" and rank == hub,
        "bytes_per_iteration": sent / iterations,
        "median_s": statistics.median(times), "mean_s": float(np.mean(times)),
        "model_bytes": sum(t.numel() for t in shared) * 4,
    }))
    dist.destroy_process_group()


def run(mode: str, nodes: int, iterations: int, tmp: Path) -> dict[str, Any]:
    world = nodes + 1 if mode == "star" else nodes
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.ring_vs_star", "--worker",
                               str(r), str(world), str(port), mode, str(iterations), str(tmp)],
                              cwd=ROOT, env=env) for r in range(world)]
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"{mode} N={nodes}: worker exit codes {codes}")
    docs = [json.loads((tmp / f"{mode}-{world}-{r}.json").read_text()) for r in range(world)]
    workers = [d for d in docs if not d["hub"]]
    hub = next((d for d in docs if d["hub"]), None)
    return {
        "mode": mode, "nodes": nodes,
        "model_bytes": workers[0]["model_bytes"],
        "worker_bytes_sent_per_iteration": statistics.mean(d["bytes_per_iteration"]
                                                           for d in workers),
        # In star, what arrives at the hub is what the workers sent: N copies.
        "hub_bytes_in_per_iteration": (sum(d["bytes_per_iteration"] for d in workers)
                                       if hub else None),
        "hub_bytes_out_per_iteration": hub["bytes_per_iteration"] if hub else None,
        "seconds_per_iteration": max(d["median_s"] for d in workers),
    }


def render(rows: list[dict[str, Any]], iterations: int) -> str:
    import platform

    model = rows[0]["model_bytes"]
    lines = [
        "# Ring (D-PSGD) vs star: bytes and time per iteration",
        "",
        "Generated by `python -m benchmarks.ring_vs_star` (see its docstring for the method).",
        f"Digits CNN, {model:,} bytes of float32 parameters; one gradient step of batch 32 per "
        f"iteration; median of {iterations} iterations after {WARMUP} warm-up ones; gloo on "
        f"loopback; machine: {os.cpu_count()} CPU(s), {platform.machine()}, "
        f"Python {platform.python_version()}.",
        "",
        "| N | ring: sent per worker | star: sent per worker | star: hub in / out | "
        "ring s/iter | star s/iter |",
        "|---|---|---|---|---|---|",
    ]
    by = {(r["mode"], r["nodes"]): r for r in rows}
    for n in sorted({r["nodes"] for r in rows}):
        ring, star = by[("ring", n)], by[("star", n)]
        lines.append(
            f"| {n} | {ring['worker_bytes_sent_per_iteration'] / model:.0f} x model "
            f"({ring['worker_bytes_sent_per_iteration']:,.0f} B) "
            f"| {star['worker_bytes_sent_per_iteration'] / model:.0f} x model "
            f"| {star['hub_bytes_in_per_iteration'] / model:.0f} x / "
            f"{star['hub_bytes_out_per_iteration'] / model:.0f} x model "
            f"| {ring['seconds_per_iteration'] * 1e3:.1f} ms "
            f"| {star['seconds_per_iteration'] * 1e3:.1f} ms |")
    lines += [
        "",
        "Reading it: a ring worker sends its copy to its two neighbours every iteration (2 x "
        "model; N=2 has one neighbour, 1 x) whatever N is, and no process carries more than "
        "that. In star each worker sends 1 x model up and gets 1 x back, but the hub moves "
        "N x model in and N x model out per iteration: its link and its CPU grow with N, the "
        "ring's do not. Times are from processes sharing this machine's cores: with more "
        "processes than cores they measure contention as much as the topology, so compare the "
        "two columns row by row, not across N. ring mode adds one O(model) upload and download "
        "per node per block (the copy for the average and consensus distance, the average for "
        "evaluation), amortised over the block's iterations.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, port, mode, iterations, out = sys.argv[2:8]
        worker(int(rank), int(world), int(port), mode, int(iterations), Path(out))
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--min-nodes", type=int, default=2)
    ap.add_argument("--max-nodes", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--out", type=Path, default=OUT_MD)
    args = ap.parse_args()
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.min_nodes, args.max_nodes + 1):
            for mode in ("ring", "star"):
                rows.append(run(mode, n, args.iterations, Path(tmp)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    args.out.write_text(render(rows, args.iterations))
    print(json.dumps({"ring_vs_star": rows}))


if __name__ == "__main__":
    main()
