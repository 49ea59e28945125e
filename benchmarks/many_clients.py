"""Many clients on one machine: `fedgpu run` against Flower's simulation (Ray backend).

The same federation both ways: fedgpu's digits task (its model and training loop, run by Flower's
clients too: benchmarks/flower_sim.py), the same per-client partitions, the same
hyperparameters, FedAvg weighted by examples, `per_round` clients of `clients` sampled each
round, on the CPU with one torch thread per client and as many clients training at once as
there are cores (fedgpu: its CPU slots; Flower: `num_cpus` 1 per client). Measured for each,
in this process, one after the other:

- wall time of the whole command (start-up, data, every round, shutdown);
- peak memory of the whole process tree, sampled every second: the sum of RSS (pages shared by
  several processes, like a forked worker's, count in each) and the sum of PSS (shared pages
  split between their sharers: what the tree really occupies). This process is made a child
  subreaper, so daemons that detach (Ray's) stay in the tree;
- accuracy of the final global model on the union of every client's held-out split, computed
  here by the same code (DigitsTask.evaluate) for both.

    python -m benchmarks.many_clients --impl fedgpu|flower --clients 100 --per-round 10 --rounds 5

`--device cuda --gpu-share 0.1` puts the clients on the GPU (not run yet: the machines this was
written on had none), each capped to that share of the card (fedgpu: `--gpu-memory-fraction`,
which is also its GPU slot; Flower: Ray's fractional `num_gpus`), and adds GPU memory: the
card's used MiB before the run, its peak, and what is left after each round (fedgpu: per round,
the largest NVML `after - before` its nodes reported, an upper bound when workers overlap;
Flower: read by the server after each round's aggregation, while no client trains).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import ROOT, bench_python, emit

_PR_SET_CHILD_SUBREAPER = 36
HP = {"lr": 0.05, "momentum": 0.9, "local_epochs": 1, "batch_size": 32}


class TreeMemory:
    """Samples the memory of every process below this one, once a second."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.peak_rss = self.peak_pss = 0
        self.peak_procs = 0
        self.peak_gpu: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        # Orphans (a daemon that double-forks) are re-parented to us, so they stay counted.
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(self.interval_s):
            rss = pss = 0
            procs = me.children(recursive=True)
            for p in procs:
                try:
                    full = p.memory_full_info()
                except psutil.Error:
                    continue
                rss += full.rss
                pss += getattr(full, "pss", full.rss)
            self.samples += 1
            if rss > self.peak_rss:
                self.peak_rss, self.peak_procs = rss, len(procs)
            self.peak_pss = max(self.peak_pss, pss)
            gpu = _gpu_used_mib()
            if gpu is not None:
                self.peak_gpu = max(self.peak_gpu or 0, gpu)


def union_accuracy(split: Path, clients: int, weights: dict[str, Any]) -> float:
    """The final model on every client's held-out split together, as fedgpu's task scores it."""
    import numpy as np
    import torch

    from fedgpu.node.tasks.digits import DigitsTask

    task = DigitsTask()
    parts = [task.load_data(split / f"node-{i}") for i in range(1, clients + 1)]
    data = {"x_test": torch.cat([p["x_test"] for p in parts]),
            "y_test": torch.cat([p["y_test"] for p in parts])}
    model = task.build_model(HP)
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()})
    _, metrics = task.evaluate(model, data, torch.device("cpu"), HP)
    return round(metrics["accuracy"], 4)


def run_fedgpu(split: Path, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_dir = work / "run"
    device = (["--gpu", "offer", "--use-gpu", "--gpu-memory-fraction", str(a.gpu_share)]
              if a.device == "cuda" else ["--gpu", "none"])
    cmd = [sys.executable, "-m", "fedgpu.cli.app", "run", "--nodes", str(a.clients),
           "--rounds", str(a.rounds), "--fraction", str(a.per_round / a.clients),
           "--data", str(split), "--run-dir", str(run_dir), *device,
           "--seed", "0", "--timeout", "3000"]
    out = _timed(cmd, work / "fedgpu.out")
    rounds = json.loads((run_dir / "rounds.json").read_text())
    from safetensors.numpy import load_file

    weights = load_file(str(run_dir / "state" / "global.safetensors"))
    history = rounds["rounds"]
    initial = (rounds.get("initial_eval") or {}).get("accuracy")
    if a.device == "cuda":
        out["gpu_left_after_round_mib"] = [max((
            u["resources"]["nvml_used_after_mib"] - u["resources"]["nvml_used_before_mib"]
            for u in r["updates"] if u["resources"].get("nvml_used_after_mib") is not None),
            default=None) for r in history]
    return {**out, "rounds_finished": sum(r["status"] == "finished" for r in history),
            "participants": [len(r["participants"]) for r in history],
            "accuracy": union_accuracy(split, a.clients, weights),
            "federated_accuracy_before_round_1": initial,
            "federated_accuracy_after": [r["eval"]["accuracy"] if r.get("eval") else None
                                         for r in history],
            "queued_s_max": max((u["resources"].get("queued_seconds", 0) for r in history
                                 for u in r["updates"]), default=0)}


def run_flower(split: Path, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    import numpy as np

    final = work / "flower-final.npz"
    cmd = [bench_python(), "-m", "benchmarks.flower_sim", "--split", str(split),
           "--clients", str(a.clients), "--per-round", str(a.per_round), "--rounds",
           str(a.rounds), "--out", str(final), "--device", a.device,
           "--gpu-share", str(a.gpu_share)]
    out = _timed(cmd, work / "flower.out")
    if a.device == "cuda":
        sim = json.loads((work / "flower.out").read_text().strip().splitlines()[-1])
        base = out.get("gpu_used_before_mib")
        out["gpu_left_after_round_mib"] = [
            None if v is None or base is None else v - base
            for v in sim["gpu_used_after_round_mib"][1:]]
    with np.load(final) as z:
        weights = {k: z[k] for k in z.files}
    return {**out, "rounds_finished": a.rounds,
            "accuracy": union_accuracy(split, a.clients, weights)}


def _timed(cmd: list[str], log: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    gpu_before = _gpu_used_mib()
    with TreeMemory() as mem, open(log, "w") as fh:
        started = time.perf_counter()
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                              timeout=3600)
        wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{log.read_text()[-3000:]}")
    out = {"wall_s": round(wall, 1), "peak_rss_mib": round(mem.peak_rss / 2**20),
           "peak_pss_mib": round(mem.peak_pss / 2**20), "processes_at_peak": mem.peak_procs,
           "memory_samples": mem.samples}
    if gpu_before is not None:
        out.update(gpu_used_before_mib=gpu_before, gpu_peak_used_mib=mem.peak_gpu)
    return out


def _gpu_used_mib(index: int = 0) -> int | None:
    """Used memory of the card (MiB), or None without NVML or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(
                pynvml.nvmlDeviceGetHandleByIndex(index)).used) >> 20
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("fedgpu", "flower"), required=True)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--gpu-share", type=float, default=0.1)
    a = ap.parse_args()
    from fedgpu.core.datasets import split_digits

    with tempfile.TemporaryDirectory() as tmp_:
        work = Path(tmp_)
        split = work / "split"
        split_digits(split, a.clients, "iid", 0.5, 0)
        load = os.getloadavg()[0]
        doc = (run_fedgpu if a.impl == "fedgpu" else run_flower)(split, a, work)
    emit({"impl": a.impl, "clients": a.clients, "per_round": a.per_round, "rounds": a.rounds,
          "device": a.device, "cpus": os.cpu_count(), "load_before": round(load, 2),
          "load_after": round(os.getloadavg()[0], 2), **doc})


if __name__ == "__main__":
    main()
