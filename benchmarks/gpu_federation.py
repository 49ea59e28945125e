"""GPU federation check, for a host with an NVIDIA GPU (not run in CI).

Runs local federations (aggregator + N nodes as processes, the same code as `fedgpu run`)
and compares what fedgpu reports with nvidia-smi:
  1. one node, `--gpu offer`: per-round NVML before/peak/after and the residual after each round
  2. three nodes sharing the GPU with `--gpu-memory-fraction 0.3`
  3. three nodes on the CPU (`--gpu none`) for round times CPU vs GPU
nvidia-smi is sampled in a thread the whole time; between rounds (no training process alive)
the GPU's used memory must be back at the level it had before the run.

    python -m benchmarks.gpu_federation --out results/   [--data PRESPLIT_DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from fedgpu.cli.run.launcher import LocalRun, LocalRunConfig, demo_job


def smi_used_mib(index: int = 0) -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={index}", "--query-gpu=memory.used",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


class SmiSampler(threading.Thread):
    def __init__(self, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, int]] = []
        self._stop_evt = threading.Event()
        self.interval = interval

    def run(self) -> None:
        while not self._stop_evt.is_set():
            used = smi_used_mib()
            if used is not None:
                self.samples.append((time.time(), used))
            self._stop_evt.wait(self.interval)

    def stop(self) -> None:
        self._stop_evt.set()
        self.join()

    def peak(self, start: float, end: float) -> int | None:
        vals = [u for t, u in self.samples if start <= t <= end]
        return max(vals) if vals else None

    def at(self, t: float) -> int | None:
        before = [u for ts, u in self.samples if ts <= t]
        return before[-1] if before else None


class PresplitRun(LocalRun):
    """LocalRun on data split elsewhere (hosts without scikit-learn)."""

    def __init__(self, cfg: LocalRunConfig, data: Path | None) -> None:
        super().__init__(cfg)
        self.presplit = data

    def prepare(self) -> tuple[Path, list[Path]]:
        if self.presplit is None:
            return super().prepare()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        dirs = sorted(self.presplit.glob("node-*"))[: self.cfg.nodes]
        job = self.run_dir / "job.toml"
        from fedgpu.core.job.reader import dumps_job

        job.write_text(dumps_job(self.cfg.job))
        return job, dirs


def run_scenario(name: str, cfg: LocalRunConfig, data: Path | None, smi: SmiSampler,
                 out: Path) -> dict[str, Any]:
    run = PresplitRun(cfg, data)
    job, dirs = run.prepare()
    baseline = smi_used_mib()
    t0 = time.time()
    try:
        run.start(job, dirs)
        state = run.watch()
        run.wait_for_exit()
    finally:
        run.stop_all()
    run.save_reports()
    t1 = time.time()
    time.sleep(1.0)
    final = smi_used_mib()
    rounds = (run.last_rounds or {}).get("rounds", [])
    per_round = []
    for r in rounds:
        start, stop = r["started_at"], r["started_at"] + r["duration_s"]
        ups = r["updates"]
        per_round.append({
            "round": r["round"],
            "duration_s": r["duration_s"],
            "train_seconds": [u["resources"]["train_seconds"] for u in ups],
            "round_seconds": [u["resources"]["round_seconds"] for u in ups],
            "fedgpu_nvml_before": [u["resources"]["nvml_used_before_mib"] for u in ups],
            "fedgpu_nvml_peak": [u["resources"]["nvml_used_peak_mib"] for u in ups],
            "fedgpu_nvml_after": [u["resources"]["nvml_used_after_mib"] for u in ups],
            "torch_peak_allocated": [u["resources"]["torch_peak_allocated_mib"] for u in ups],
            "torch_peak_reserved": [u["resources"]["torch_peak_reserved_mib"] for u in ups],
            "smi_peak_during_round": smi.peak(start, stop),
            "smi_after_round": smi.at(stop + 0.5),
            "eval_accuracy": (r.get("eval") or {}).get("accuracy"),
            "devices": sorted({u["gpu_decision"]["device"] for u in ups}),
        })
    shutil.copytree(run.run_dir / "logs", out / f"{name}-logs", dirs_exist_ok=True)
    return {
        "scenario": name,
        "state": state,
        "nodes": cfg.nodes,
        "gpu": cfg.gpu,
        "memory_fraction": cfg.gpu_memory_fraction,
        "wall_s": round(t1 - t0, 1),
        "smi_baseline_mib": baseline,
        "smi_after_run_mib": final,
        "rounds": per_round,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    smi = SmiSampler()
    smi.start()
    results = []
    def cfg(nodes: int, **knobs: Any) -> LocalRunConfig:
        return LocalRunConfig(nodes=nodes, job=demo_job(nodes=nodes, rounds=args.rounds), **knobs)

    scenarios = [
        ("gpu-1node", cfg(1, gpu="offer")),
        # The same without pre-started workers: what a round pays for starting its process.
        ("gpu-1node-no-prestart", cfg(1, gpu="offer", node_env={"FEDGPU_PRESTART": "0"})),
        ("gpu-3nodes-shared-0.3", cfg(3, gpu="offer", gpu_memory_fraction=0.3)),
        ("cpu-3nodes", cfg(3, gpu="none")),
    ]
    if args.only:
        scenarios = [s for s in scenarios if s[0] in args.only.split(",")]
    try:
        for name, cfg in scenarios:
            cfg.run_dir = args.out / "runs" / name
            cfg.torch_threads = 2
            print(f"=== {name}", flush=True)
            results.append(run_scenario(name, cfg, args.data, smi, args.out))
            print(json.dumps(results[-1], indent=1), flush=True)
    finally:
        smi.stop()
    (args.out / "gpu_federation.json").write_text(json.dumps(results, indent=1))
    for res in results:
        secs = [s for r in res["rounds"] for s in r["round_seconds"]]
        print(f"{res['scenario']}: state {res['state']}, mean node round "
              f"{statistics.mean(secs) if secs else float('nan'):.2f}s, baseline "
              f"{res['smi_baseline_mib']} MiB, after run {res['smi_after_run_mib']} MiB")


if __name__ == "__main__":
    main()
