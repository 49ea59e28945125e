"""Run every benchmark and write BENCHMARKS.md (`make bench`).

Flower's side runs in .venv-bench (see benchmarks/common.py for why); everything else in the
project's venv. Each measurement is its own process so peak memory is its own.

`python -m benchmarks.run_all --only throughput` re-runs one section and keeps the others'
numbers from benchmarks/results.json (the section then names its own machine and load).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, bench_python, run_case

SECTIONS = ("aggregation", "transport", "serialization", "scale", "isolation", "throughput",
            "many", "bigmodel")
RESULTS = ROOT / "benchmarks" / "results.json"


def _version(python: str, pkg: str) -> str:
    code = f"import importlib.metadata as m; print(m.version('{pkg}'))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or "not installed"


def machine() -> dict[str, str]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), platform.processor())
    mem = next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
               if ln.startswith("MemTotal"))
    return {"cpu": f"{cpu}, {os.cpu_count()} logical CPUs",
            "memory": f"{int(mem) / 1024 / 1024:.1f} GiB", "os": platform.platform(),
            "python": platform.python_version()}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=SECTIONS, action="append",
                    help="re-run these sections only, keeping the others from results.json")
    a = ap.parse_args()
    if a.only:
        r = json.loads(RESULTS.read_text())
        run_sections(r, set(a.only))
    else:
        started = time.time()
        r = {"load_before": os.getloadavg()[0]}
        run_sections(r, set(SECTIONS))
        r["versions"] = versions()
        r["machine"] = machine()
        r["minutes"] = round((time.time() - started) / 60, 1)
        # Other work on the same 2 vCPUs skews every number; the load average says how much.
        r["load_after"] = os.getloadavg()[0]
    from benchmarks.report import render

    (ROOT / "BENCHMARKS.md").write_text(render(r))
    RESULTS.write_text(json.dumps(r, indent=1))
    log("wrote BENCHMARKS.md")


def run_sections(r: dict[str, Any], only: set[str]) -> None:
    flower = bench_python()
    if "aggregation" in only:
        _aggregation(r, flower)
    if "transport" in only:
        _transport(r)
    if "serialization" in only:
        log("serialization")
        r["ser"] = [run_case("benchmarks.serialization", ["--impl", "fedgpu"]),
                    run_case("benchmarks.serialization", ["--impl", "flower"], python=flower)]
    if "scale" in only:
        log("scale")
        r["scale"] = run_case("benchmarks.scale", [], timeout=1200)
    if "isolation" in only:
        log("isolation")
        r["iso"] = run_case("benchmarks.isolation", ["--rounds", "5"])
    if "many" in only:
        _many(r, flower)
    if "bigmodel" in only:
        _bigmodel(r)
    if "throughput" in only:
        log("throughput (CPU version; the GPU one: docs/measurements/gpu-throughput.md)")
        r["tput"] = run_case("benchmarks.gpu_throughput", ["--device", "cpu"], timeout=1800)
        r["tput_machine"] = machine()


def _transport(r: dict[str, Any]) -> None:
    """Raw sockets, gRPC and the bulk port side by side, one after the other in one run."""
    log("transport: raw TCP, raw TLS, gRPC, fedgpu gRPC and bulk paths (plain and TLS)")
    r["transport_machine"] = {**machine(), "load_before": os.getloadavg()[0]}
    r["raw"] = run_case("benchmarks.transport", ["raw", "--chunk-kib", "1024"])
    r["tls_raw"] = run_case("benchmarks.transport", ["tls", "--chunk-kib", "1024"])
    r["bare"] = run_case("benchmarks.transport", ["bare", "--chunk-kib", "1024"])
    r["grpc"] = [run_case("benchmarks.transport", ["grpc", "--chunk-kib", "1024"])]
    e2e = ["--rounds", "5", "--chunk-kib", "1024"]
    r["e2e"] = [run_case("benchmarks.wire_e2e", ["--path", "grpc", *e2e])]
    r["e2e_bulk"] = run_case("benchmarks.wire_e2e", ["--path", "bulk", *e2e])
    r["e2e_bulk_tls"] = run_case("benchmarks.wire_e2e", ["--path", "bulk", "--tls", *e2e])
    r["transport_machine"]["load_after"] = os.getloadavg()[0]


def _bigmodel(r: dict[str, Any]) -> None:
    """Six 3.4 GB updates into one FedAvg round, over the bulk port and over gRPC only."""
    log("big model round: 6 x 3.4 GB, bulk then gRPC only")
    big: dict[str, Any] = {"machine": {**machine(), "load_before": os.getloadavg()[0]}}
    for path in ("bulk", "grpc"):
        big[path] = run_case("benchmarks.big_round", ["--path", path], timeout=3600)
    big["machine"]["load_after"] = os.getloadavg()[0]
    r["big"] = big


def _aggregation(r: dict[str, Any], flower: str) -> None:
    log("aggregation")
    r["agg"] = []
    for k, params in ((10, 11_000_000), (100, 1_000_000)):
        args = ["--k", str(k), "--params", str(params)]
        for impl in ("fedgpu", "fedgpu_stream", "fedgpu_stream_normed", "numpy", "bound"):
            r["agg"].append(run_case("benchmarks.aggregation", ["--impl", impl, *args]))
        r["agg"].append(run_case("benchmarks.aggregation", ["--impl", "flower", *args],
                                 python=flower))


def _many(r: dict[str, Any], flower: str) -> None:
    """fedgpu and Flower's simulation side by side (benchmarks/many_clients.py)."""
    log("many clients: fedgpu vs Flower's simulation, 100 clients, 10 per round, 5 rounds")
    args = ["--clients", "100", "--per-round", "10", "--rounds", "5"]
    r["many"] = {
        "fedgpu": run_case("benchmarks.many_clients", ["--impl", "fedgpu", *args], timeout=3600),
        "flower": run_case("benchmarks.many_clients", ["--impl", "flower", *args], timeout=3600),
        "fedgpu_100x3": run_case("benchmarks.many_clients", [
            "--impl", "fedgpu", "--clients", "100", "--per-round", "10", "--rounds", "3"],
            timeout=3600),
        "flwr": _version(flower, "flwr"), "ray": _version(flower, "ray"),
        "machine": machine(),
    }


def versions() -> dict[str, str]:
    flower = bench_python()
    return {
        "fedgpu": md.version("fedgpu"), "numpy": md.version("numpy"),
        "grpcio": md.version("grpcio"), "protobuf": md.version("protobuf"),
        "torch": md.version("torch"),
        "flwr (in .venv-bench)": _version(flower, "flwr"),
        "numpy (in .venv-bench)": _version(flower, "numpy"),
        "protobuf (in .venv-bench)": _version(flower, "protobuf"),
    }


if __name__ == "__main__":
    main()
