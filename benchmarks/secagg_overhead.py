"""Secure aggregation against a plain round, side by side in one run: K simulated sites
(`fedgpu sim`, which speaks the protocol) against a real aggregator, the same job with and
without `secure_aggregation`.

    python -m benchmarks.secagg_overhead --sites 10 50 100 --params 1000000 11000000

One JSON line per (K, params): the median round time of each, the overhead, the protocol's
time (first keys to result) and the aggregator's unmasking time, and the aggregator's peak RSS.
With `--flower` (and .venv-bench, `make .venv-bench/.installed`), Flower's SecAgg+ on the same
K and sizes runs too (benchmarks/flower_secagg.py: its simulation, plain and secure; the first
round, Ray's warm-up, left out) and the line has both overheads and their ratio.
The sites all run on this machine, so with K sites the machine does K sites' masking too: on
few cores that, not the aggregator, dominates the secure round (for both frameworks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    bench_python,
    emit,
    free_port,
    proc_rss_mib,
    query,
    spawn,
    start_aggregator,
    stop,
)


def _job(path: Path, sites: int, rounds: int, secure: dict[str, Any] | None) -> Path:
    lines = ['task = "synthetic"', f"rounds = {rounds}", f"min_nodes = {sites}",
             "fraction = 1.0", "evaluate = false", "use_gpu = false", "round_deadline_s = 1800"]
    if secure is not None:
        lines += ["", "[secure_aggregation]", *(f"{k} = {json.dumps(v)}"
                                                for k, v in secure.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(tmp: Path, tag: str, sites: int, params: int, rounds: int, processes: int,
         secure: dict[str, Any] | None) -> dict[str, Any]:
    job = _job(tmp / f"{tag}.toml", sites, rounds, secure)
    agg, address = start_aggregator(job, tmp / f"{tag}-agg.log", "--bulk-port",
                                    str(free_port()))
    per = -(-sites // processes)
    sims = [spawn(["sim", "--aggregator", address, "--nodes", str(min(per, sites - i * per)),
                   "--start-index", str(i * per), "--params", str(params), "--poll-s", "5",
                   "--stats", str(tmp / f"{tag}-sim{i}.json"), "--log-level", "WARNING"],
                  tmp / f"{tag}-sim{i}.log") for i in range(processes) if i * per < sites]
    try:
        peak, start = 0.0, time.monotonic()
        while True:
            doc = query(address, "GetStatus")
            peak = max(peak, proc_rss_mib(agg.pid)[1])
            if doc["state"] in ("finished", "failed"):
                break
            if time.monotonic() - start > 3600:
                raise RuntimeError(f"{tag}: rounds did not finish")
            time.sleep(0.5)
        rounds_doc = query(address, "ListRounds")["rounds"]
    finally:
        for s in sims:
            stop(s)
        stop(agg)
    done = [r for r in rounds_doc if r["round"] >= 1 and r["status"] == "finished"]
    out: dict[str, Any] = {"state": doc["state"], "rounds_finished": len(done),
                           "round_s": round(statistics.median(r["duration_s"] for r in done), 3)
                           if done else None, "agg_peak_rss_mib": round(peak, 1)}
    sa = [r["secure_aggregation"] for r in done if "secure_aggregation" in r]
    if sa:
        out["protocol_s"] = round(statistics.median(s["protocol_s"] for s in sa), 3)
        out["unmask_s"] = round(statistics.median(s["unmask_s"] for s in sa), 3)
        out["neighbours"] = sa[0]["neighbours"]
        # The ring the rounds used (ring_bits = "auto" picks it per round).
        out["ring_bits"] = sorted({s.get("ring_bits") for s in sa}, key=str)
    return out


def _flower(tmp: Path, sites: int, params: int, rounds: int, secure: bool,
            neighbours: Any) -> float | None:
    """Flower's median round seconds (rounds after the first), or None if it failed."""
    import subprocess

    args = [bench_python(), "-m", "benchmarks.flower_secagg", "--clients", str(sites),
            "--params", str(params), "--rounds", str(rounds + 1)]
    if not secure:
        args.append("--plain")
    elif neighbours != "all" and int(neighbours) < sites - 1:
        # Flower counts the shares with the client's own: k neighbours are k + 1 shares.
        args += ["--num-shares", str(int(neighbours) + 1)]
    log = tmp / f"flower-k{sites}-p{params}-{'secure' if secure else 'plain'}.log"
    with open(log, "wb") as fh:
        r = subprocess.run(args, stdout=subprocess.PIPE, stderr=fh, timeout=3600)
    lines = r.stdout.decode().strip().splitlines()
    if r.returncode != 0 or not lines:
        return None
    times = json.loads(lines[-1])["round_s"][1:]
    return round(statistics.median(times), 3) if times else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sites", type=int, nargs="+", default=[10, 50, 100])
    ap.add_argument("--params", type=int, nargs="+", default=[1_000_000, 11_000_000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--processes", type=int, default=2, help="sim processes")
    ap.add_argument("--neighbours", default="all", help='"all" or the SecAgg+ degree k')
    ap.add_argument("--flower", action="store_true", help="Flower's SecAgg+ side by side")
    ap.add_argument("--settings", default="{}", help='more [secure_aggregation] keys as JSON, '
                    'e.g. \'{"ring_bits": 32, "bits": 16, "max_weight": 1000}\'')
    a = ap.parse_args()
    neighbours: Any = a.neighbours if a.neighbours == "all" else int(a.neighbours)
    secure = {"neighbours": neighbours, "stage_timeout_s": 600, **json.loads(a.settings)}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        for params in a.params:
            for sites in a.sites:
                tag = f"k{sites}-p{params}"
                plain = _run(tmp, f"{tag}-plain", sites, params, a.rounds, a.processes, None)
                sec = _run(tmp, f"{tag}-secure", sites, params, a.rounds, a.processes, secure)
                over = (sec["round_s"] - plain["round_s"]
                        if sec["round_s"] is not None and plain["round_s"] is not None else None)
                doc: dict[str, Any] = {"sites": sites, "params": params, "settings": secure,
                                       "plain": plain,
                                       "secure": sec,
                                       "overhead_s": None if over is None else round(over, 3)}
                if a.flower:
                    fp = _flower(tmp, sites, params, a.rounds, False, neighbours)
                    fs = _flower(tmp, sites, params, a.rounds, True, neighbours)
                    f_over = fs - fp if fs is not None and fp is not None else None
                    doc["flower"] = {"plain_round_s": fp, "secure_round_s": fs,
                                     "overhead_s": None if f_over is None else round(f_over, 3)}
                    if over is not None and f_over:
                        doc["overhead_ratio"] = round(over / f_over, 3)
                emit(doc)


if __name__ == "__main__":
    main()
