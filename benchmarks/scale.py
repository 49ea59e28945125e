"""1,000 simulated nodes against one aggregator: registration, idle cost, rounds of 100.

    python -m benchmarks.scale --nodes 1000 --per-round 100 --rounds 20 --params 1000000
Phase 1 (idle): every node registered, heartbeating and long-polling, no round running; the
aggregator's CPU share over a fixed window. Phase 2: the rounds, timed from `fedgpu rounds`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    emit,
    proc_cpu_seconds,
    proc_rss_mib,
    query,
    spawn,
    start_aggregator,
    stop,
    write_job,
)


def _sims(address: str, nodes: int, processes: int, params: int, tmp: Path, tag: str
          ) -> list:  # type: ignore[type-arg]
    per = nodes // processes
    return [spawn(["sim", "--aggregator", address, "--nodes", str(per), "--start-index",
                   str(i * per), "--params", str(params), "--stats", str(tmp / f"{tag}{i}.json"),
                   "--log-level", "WARNING"], tmp / f"{tag}{i}.log") for i in range(processes)]


def _wait_registered(address: str, nodes: int, timeout: float = 300) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if query(address, "GetStatus")["nodes"]["registered"] >= nodes:
            return time.perf_counter() - start
        time.sleep(0.5)
    raise RuntimeError("nodes did not all register")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--idle-window", type=float, default=20.0)
    a = ap.parse_args()
    out: dict[str, object] = {"nodes": a.nodes, "per_round": a.per_round, "rounds": a.rounds,
                              "params": a.params, "sim_processes": a.processes}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        # Phase 1: a pool one larger than will ever connect, so no round starts.
        idle_job = write_job(tmp / "idle.toml", task="synthetic", rounds=1, min_nodes=1,
                             min_available_nodes=a.nodes + 1, use_gpu=False)
        agg, address = start_aggregator(idle_job, tmp / "idle-agg.log")
        sims = _sims(address, a.nodes, a.processes, a.params, tmp, "idle")
        try:
            out["register_seconds"] = round(_wait_registered(address, a.nodes), 2)
            time.sleep(5)  # past the first heartbeat of every node
            cpu0, t0 = proc_cpu_seconds(agg.pid), time.perf_counter()
            time.sleep(a.idle_window)
            cpu = proc_cpu_seconds(agg.pid) - cpu0
            out["idle_cpu_pct"] = round(100 * cpu / (time.perf_counter() - t0), 1)
            out["idle_rss_mib"] = round(proc_rss_mib(agg.pid)[0], 1)
            out["idle_alive"] = query(address, "GetStatus")["nodes"]["alive"]
        finally:
            for s in sims:
                stop(s)
            stop(agg)

        job = write_job(tmp / "job.toml", task="synthetic", rounds=a.rounds,
                        min_nodes=a.per_round, min_available_nodes=a.nodes,
                        fraction=a.per_round / a.nodes, evaluate=False, use_gpu=False,
                        round_deadline_s=600)
        agg, address = start_aggregator(job, tmp / "agg.log")
        sims = _sims(address, a.nodes, a.processes, a.params, tmp, "run")
        try:
            _wait_registered(address, a.nodes)
            start = time.perf_counter()
            peak = 0.0
            while True:
                doc = query(address, "GetStatus")
                peak = max(peak, proc_rss_mib(agg.pid)[1])
                if doc["state"] in ("finished", "failed"):
                    break
                if time.perf_counter() - start > 900:
                    raise RuntimeError("rounds did not finish")
                time.sleep(0.5)
            out["state"] = doc["state"]
            out["run_seconds"] = round(time.perf_counter() - start, 1)
            rounds = query(address, "ListRounds")["rounds"]
            peak = max(peak, proc_rss_mib(agg.pid)[1])
        finally:
            for s in sims:
                stop(s)
            stop(agg)
        errors = sum(len(json.loads((tmp / f"run{i}.json").read_text())["errors"])
                     for i in range(a.processes) if (tmp / f"run{i}.json").exists())
    durations = [r["duration_s"] for r in rounds if r["round"] >= 1]
    out.update({
        "rounds_finished": sum(r["status"] == "finished" for r in rounds),
        "participants": sorted({len(r["participants"]) for r in rounds}),
        "round_s_median": round(statistics.median(durations), 3),
        "round_s_max": round(max(durations), 3),
        "agg_peak_rss_mib": round(peak, 1),
        "sim_errors": errors,
    })
    emit(out)


if __name__ == "__main__":
    main()
