"""Data-parallel rounds (`[resources] workers`): the round machinery's own paths, measured.

Every case is a real round of the images task on one site's data, through the node's round
machinery: `process.run_task` (one spawned worker, the plain training loop) or
`ddp_launch.run_workers` (N spawned workers, DistributedDataParallel). Figures come from the
workers' own clocks (samples/s of the training loop, which excludes process start-up); each
case runs a warm-up round first that is not counted.

  cpu   1 worker (1 thread), 1 worker (2 threads), 2 gloo workers (1 thread each); samples/s
        and the training time until the held-out accuracy reaches --target (the same seed and
        global batch give the same model, so the same number of rounds).
  cuda  the plain loop on one GPU vs one worker through the distributed path on it (target:
        >= 97%), and, where the host has N >= 2 GPUs, N workers (global batch N x the one-GPU
        batch; target: >= 0.9 x N the one-GPU samples/s). What the host lacks is skipped.

    python -m benchmarks.ddp_workers --device cpu        # what BENCHMARKS.md reports for CPU
    python -m benchmarks.ddp_workers --device cuda       # on a GPU host: < 4 minutes on one GPU
Prints one JSON document and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedgpu.core.synth_images import synth_images
from fedgpu.node.policy import Decision
from fedgpu.node.rounds.ddp_launch import run_workers
from fedgpu.node.rounds.process import RoundOutcome, run_task

CPU = Decision(mode="none", use_gpu=False, device="cpu", gpu_index=None, gpu_uuid=None,
               gpu_name=None, memory_fraction=None, reason="benchmark")
CPU_HP = {"depth": 8, "width": 8, "image_size": 16, "batch_size": 32, "num_workers": 0,
          "augment": False, "lr": 0.05, "local_epochs": 1}
GPU_HP = {"depth": 18, "width": 64, "image_size": 32, "batch_size": 256, "num_workers": -1,
          "amp": "bf16", "channels_last": True, "cudnn_benchmark": True, "lr": 0.1,
          "local_epochs": 4, "max_steps": 100}


def _round(tmp: Path, data: Path, hp: dict[str, Any], payload: bytes | None, kind: str,
           decisions: list[Decision] | None, threads: int | None) -> RoundOutcome:
    args: dict[str, Any] = dict(kind=kind, task_name="images", hyperparameters=hp, seed=7,
                                round_number=1, data_dir=data, payload=payload, work_root=tmp,
                                sampler=None, torch_threads=threads, timeout_s=600)
    out = (run_task(decision=CPU if decisions is None else decisions[0], **args)
           if decisions is None or kind == "init"
           else run_workers(decisions=decisions, **args))
    if not out.ok:
        raise SystemExit(f"round failed: {out.error}")
    return out


def _case(tmp: Path, data: Path, hp: dict[str, Any], init: bytes, decisions: list[Decision]
          | None, threads: int | None, rounds: int, target: float | None) -> dict[str, Any]:
    """`rounds` measured rounds after a warm-up one; each round starts from the last."""
    payload = init
    warm = _round(tmp, data, hp, payload, "train", decisions, threads)
    warm.cleanup()
    rates, train_s, reached = [], 0.0, None
    for r in range(rounds):
        out = _round(tmp, data, hp, payload, "train", decisions, threads)
        acc = out.result["eval_metrics"].get("accuracy", 0.0)  # of the weights it was sent
        if target is not None and reached is None and acc >= target:
            reached = {"rounds": r, "train_seconds": round(train_s, 2)}
        rates.append(out.result["train_metrics"]["examples_per_s"])
        train_s += float(out.resources.get("train_seconds") or 0.0)
        assert out.weights is not None
        payload = out.weights.read_bytes()
        out.cleanup()
    rates.sort()
    return {"samples_per_s": rates[len(rates) // 2], "samples_per_s_each": rates,
            "to_target": reached, "train_seconds": round(train_s, 2)}


def _gpu_decisions() -> list[Decision]:
    from fedgpu.node import nvml
    from fedgpu.node.gpu_records import training_devices

    snap = nvml.snapshot()
    if not snap.available:
        return []
    return [Decision(mode="enforce", use_gpu=True, device="cuda", gpu_index=g.index,
                     gpu_uuid=g.uuid, gpu_name=g.name, memory_fraction=None, reason="benchmark")
            for g in training_devices(snap.gpus) if g.healthy]


def run_cpu(tmp: Path, rounds: int, target: float) -> dict[str, Any]:
    data = synth_images(tmp / "img", 1, classes=4, per_class=150, size=16)[0]
    init = _round(tmp, data, CPU_HP, None, "init", None, 1)
    payload = init.weights.read_bytes()  # type: ignore[union-attr]
    cases = {
        "1 worker, 1 thread": _case(tmp, data, CPU_HP, payload, None, 1, rounds, target),
        "1 worker, 2 threads": _case(tmp, data, CPU_HP, payload, None, 2, rounds, target),
        "2 gloo workers, 1 thread each": _case(tmp, data, CPU_HP, payload, [CPU, CPU], 1,
                                               rounds, target),
    }
    base = cases["1 worker, 1 thread"]["samples_per_s"]
    for c in cases.values():
        c["vs_1_worker_1_thread"] = round(c["samples_per_s"] / base, 3)
    return {"device": "cpu", "hyperparameters": CPU_HP, "target_accuracy": target,
            "cases": cases}


def run_cuda(tmp: Path, rounds: int) -> dict[str, Any]:
    gpus = _gpu_decisions()
    if not gpus:
        return {"device": "cuda", "skipped": "NVML sees no GPU: nothing to measure"}
    data = synth_images(tmp / "img", 1, classes=10, per_class=1000, size=32)[0]
    init = _round(tmp, data, GPU_HP, None, "init", [gpus[0]], None)
    payload = init.weights.read_bytes()  # type: ignore[union-attr]
    threads = None  # the launcher's default: the host's cores shared by the workers
    one_plain = _plain_gpu(tmp, data, payload, gpus[0], rounds)
    one_ddp = _case(tmp, data, GPU_HP, payload, [gpus[0]], threads, rounds, None)
    doc: dict[str, Any] = {
        "device": "cuda", "gpu": gpus[0].gpu_name, "gpus_seen": len(gpus),
        "hyperparameters": GPU_HP,
        "cases": {"plain loop, 1 GPU": one_plain, "distributed path, 1 worker": one_ddp},
        "ddp_1_vs_plain": round(one_ddp["samples_per_s"] / one_plain["samples_per_s"], 3),
        "target_ddp_1_vs_plain": 0.97,
    }
    if len(gpus) >= 2:
        n = len(gpus)
        hp = dict(GPU_HP, batch_size=GPU_HP["batch_size"] * n)  # the same batch per GPU
        many = _case(tmp, data, hp, payload, gpus, threads, rounds, None)
        doc["cases"][f"distributed path, {n} workers"] = many
        doc["scaling_vs_1_gpu"] = round(many["samples_per_s"] / one_plain["samples_per_s"], 3)
        doc["target_scaling"] = round(0.9 * n, 2)
    else:
        doc["skipped"] = "one GPU: the N-GPU case needs a host with 2 or more"
    return doc


def _plain_gpu(tmp: Path, data: Path, payload: bytes, gpu: Decision,
               rounds: int) -> dict[str, Any]:
    """The plain loop (process.run_task, one worker, no torch.distributed) on `gpu`."""
    rates = []
    for r in range(rounds + 1):
        out = run_task(kind="train", task_name="images", hyperparameters=GPU_HP, seed=7,
                       round_number=1, data_dir=data, payload=payload, decision=gpu,
                       work_root=tmp, sampler=None, torch_threads=None, timeout_s=600)
        if not out.ok:
            raise SystemExit(f"round failed: {out.error}")
        if r:  # the first is the warm-up
            rates.append(out.result["train_metrics"]["examples_per_s"])
        out.cleanup()
    rates.sort()
    return {"samples_per_s": rates[len(rates) // 2], "samples_per_s_each": rates}


def markdown(doc: dict[str, Any]) -> str:
    lines = ["| case | samples/s | vs baseline | to target accuracy |", "|---|---|---|---|"]
    for name, c in doc.get("cases", {}).items():
        reached = c.get("to_target")
        to = (f"{reached['train_seconds']} s ({reached['rounds']} rounds)" if reached
              else "-" if "to_target" not in c else "not reached")
        ratio = c.get("vs_1_worker_1_thread", "")
        lines.append(f"| {name} | {c['samples_per_s']:.1f} | {ratio} | {to} |")
    for key in ("ddp_1_vs_plain", "scaling_vs_1_gpu", "skipped"):
        if key in doc:
            lines.append(f"\n{key}: {doc[key]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per case")
    p.add_argument("--target", type=float, default=0.9, help="CPU: accuracy to reach")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--steps", type=int, default=GPU_HP["max_steps"],
                   help="cuda: training steps per round (longer rounds, steadier rates)")
    args = p.parse_args(argv)
    GPU_HP["max_steps"] = args.steps
    os.environ.setdefault("OMP_NUM_THREADS", "1" if args.device == "cpu" else "4")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedgpu-ddp-bench-") as tmp:
        doc = (run_cpu(Path(tmp), args.rounds, args.target) if args.device == "cpu"
               else run_cuda(Path(tmp), args.rounds))
    doc["wall_seconds"] = round(time.monotonic() - started, 1)
    doc["load_average"] = os.getloadavg()
    doc["cpus"] = os.cpu_count()
    print(json.dumps(doc))
    print(markdown(doc))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
