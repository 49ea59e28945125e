"""Training throughput: a fedgpu round through the agent and its worker vs a plain PyTorch loop.

The same model (the images task's ResNet), the same data (synthetic 32x32 PNGs on disk, decoded
and augmented by the task's Dataset in DataLoader workers) and the same number of steps:
  plain   a fresh `python -m benchmarks.gpu_throughput plain ...` process: a hand-written loop
          (DataLoader with pinned memory and persistent workers, autocast, channels_last, SGD)
          that trains for --seconds and counts its steps
  fedgpu  `fedgpu server start` + one `fedgpu node start` (round workers forked by its worker
          factory, the default) running a job of the images task with max_steps = the plain
          loop's steps; every round is a fresh worker process, as in production
Reported: images/s of each training loop, images/s over the whole fedgpu round as the aggregator
timed it (task sent to update folded in), round overhead (round minus the node's training
loop), time to first step, and on a GPU the NVML memory before / peak / after each round.

    python -m benchmarks.gpu_throughput                # preset for the device torch sees
    python -m benchmarks.gpu_throughput --device cpu   # the small CPU version (make bench)
    python -m benchmarks.gpu_throughput --out DIR      # also keep the JSON and every log
The GPU preset is the one docs/measurements/gpu-throughput.md gives: ResNet-18, batch 256, bf16
autocast,
channels_last, cuDNN autotuning, 60 s of training per round, 50,000 training images.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, emit, query, spawn, start_aggregator, stop


@dataclass(frozen=True)
class Preset:
    depth: int
    width: int
    batch: int
    amp: str
    channels_last: bool
    cudnn_benchmark: bool
    seconds: float
    per_class: int
    workers: int  # -1: the runner's automatic choice, and the same number in the plain loop
    threads: int | None
    rounds: int = 2


PRESETS = {
    "cuda": Preset(depth=18, width=64, batch=256, amp="bf16", channels_last=True,
                   cudnn_benchmark=True, seconds=60, per_class=5010, workers=-1, threads=None),
    # The same loop, small: ResNet-8 of width 16 and 1 torch thread, on a 2-core machine.
    "cpu": Preset(depth=8, width=16, batch=64, amp="off", channels_last=False,
                  cudnn_benchmark=False, seconds=10, per_class=310, workers=1, threads=1),
}
HELD_OUT_PER_CLASS = 10  # evaluation is part of every round; kept small, it is not measured


def hparams(p: Preset, max_steps: int) -> dict[str, Any]:
    return {"depth": p.depth, "width": p.width, "batch_size": p.batch, "amp": p.amp,
            "channels_last": p.channels_last, "cudnn_benchmark": p.cudnn_benchmark,
            "num_workers": p.workers, "local_epochs": 1_000_000, "max_steps": max_steps,
            "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}


def plain(a: argparse.Namespace) -> None:
    """The hand-written loop, in its own process; `a.launched` dates the process start."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from fedgpu.node.rounds.switches import LoopSettings, workers_for
    from fedgpu.node.tasks.images import ImagesTask

    p = Preset(**json.loads(a.preset))
    device = torch.device(a.device)
    if p.threads:
        torch.set_num_threads(p.threads)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = p.cudnn_benchmark
    task = ImagesTask()
    hp = {"depth": p.depth, "width": p.width}
    model = task.build_model(hp).to(device)
    fmt = torch.channels_last if p.channels_last else torch.preserve_format
    model = model.to(memory_format=fmt)
    train = task.load_datasets(Path(a.data), hp).train
    workers = workers_for(LoopSettings(num_workers=p.workers), device.type)
    cuda = device.type == "cuda"
    loader = DataLoader(train, batch_size=p.batch, shuffle=True, num_workers=workers,
                        pin_memory=cuda, drop_last=True, persistent_workers=workers > 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(p.amp)
    model.train()
    steps = images = 0
    first_loop = first_launch = 0.0
    start = time.perf_counter()
    done = False
    while not done:
        for x, y in loader:
            x = x.to(device, non_blocking=cuda, memory_format=fmt)
            y = y.to(device, non_blocking=cuda)
            with (torch.autocast(device.type, dtype=dtype) if dtype is not None
                  else contextlib.nullcontext()):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
            images += len(y)
            if steps == 1:
                if cuda:
                    torch.cuda.synchronize()
                first_loop = time.perf_counter() - start
                first_launch = time.time() - a.launched
            if time.perf_counter() - start >= p.seconds:
                done = True
                break
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    emit({"steps": steps, "images": images, "loop_s": round(seconds, 3),
          "images_per_s": round(images / seconds, 1), "workers": workers,
          "first_step_loop_s": round(first_loop, 3),
          "first_step_from_launch_s": round(first_launch, 3),
          "device_name": torch.cuda.get_device_name(device) if cuda else _cpu_name(),
          "torch": torch.__version__})


def _cpu_name() -> str:
    from benchmarks.run_all import machine

    return machine()["cpu"]


def run_plain(p: Preset, device: str, data: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.gpu_throughput", "plain", "--device", device,
           "--data", str(data), "--preset", json.dumps(asdict(p)), "--launched"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([*cmd, repr(time.time())], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=p.seconds + 600)
    if out.returncode != 0:
        raise RuntimeError(f"the plain loop failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_job(path: Path, p: Preset, use_gpu: bool, max_steps: int) -> Path:
    lines = ['task = "images"', f"rounds = {p.rounds}", "min_nodes = 1", "fraction = 1.0",
             f"round_deadline_s = {p.seconds * 5 + 600}",
             f"use_gpu = {'true' if use_gpu else 'false'}", "seed = 0", "", "[hyperparameters]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in hparams(p, max_steps).items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_fedgpu(p: Preset, device: str, data: Path, steps: int, work: Path) -> dict[str, Any]:
    job = write_job(work / "job.toml", p, device == "cuda", steps)
    agg, address = start_aggregator(job, work / "aggregator.log", "--state-dir",
                                    str(work / "state"))
    node_args = ["node", "start", "--aggregator", address, "--data", str(data), "--name",
                 "bench", "--gpu", "offer" if device == "cuda" else "none",
                 "--status-file", str(work / "node.status.json")]
    if p.threads:
        node_args += ["--torch-threads", str(p.threads)]
    node = spawn(node_args, work / "node.log")
    try:
        deadline = time.monotonic() + p.rounds * (p.seconds * 3 + 300) + 300
        while True:
            status = query(address, "GetStatus")
            if status["state"] in ("finished", "failed"):
                break
            if node.poll() is not None:
                raise RuntimeError(f"the node exited: {(work / 'node.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the fedgpu job did not finish in time")
            time.sleep(1)
        if status["state"] != "finished":
            raise RuntimeError(f"the fedgpu job failed: {status.get('error')}")
        rounds = query(address, "ListRounds")["rounds"]
    finally:
        stop(node)
        stop(agg)
    out = []
    for r in rounds:
        u = r["updates"][0]
        res, m = u["resources"], u["train_metrics"]
        images = int(m["steps"]) * p.batch
        out.append({
            "round": r["round"], "round_s": r["duration_s"], "node_round_s": res["round_seconds"],
            "loop_s": res["train_seconds"], "steps": int(m["steps"]), "images": images,
            "loop_images_per_s": m["examples_per_s"],
            "round_images_per_s": round(images / r["duration_s"], 1),
            "overhead_s": round(r["duration_s"] - res["train_seconds"], 3),
            "first_step_s": m["first_step_s"], "device": res["device"],
            "nvml_before_mib": res["nvml_used_before_mib"],
            "nvml_peak_mib": res["nvml_used_peak_mib"],
            "nvml_after_mib": res["nvml_used_after_mib"],
            "torch_peak_reserved_mib": res["torch_peak_reserved_mib"],
        })
    return {"rounds": out}


def main() -> None:
    if sys.argv[1:2] == ["plain"]:
        ap = argparse.ArgumentParser()
        ap.add_argument("--device", required=True)
        ap.add_argument("--data", required=True)
        ap.add_argument("--preset", required=True)
        ap.add_argument("--launched", type=float, required=True)
        plain(ap.parse_args(sys.argv[2:]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--seconds", type=float, help="training per round (preset: 60 GPU, 10 CPU)")
    ap.add_argument("--rounds", type=int, help="fedgpu rounds (preset: 2; the last is headline)")
    ap.add_argument("--data", type=Path, help="an existing synth-images node dir to reuse")
    ap.add_argument("--out", type=Path, help="keep the JSON and the logs here")
    a = ap.parse_args()
    device = a.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    p = PRESETS[device]
    p = replace(p, seconds=a.seconds or p.seconds, rounds=a.rounds or p.rounds)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fedgpu-tput-") as tmp_:
        work = Path(tmp_)
        data = a.data
        if data is None:
            from fedgpu.core.synth_images import synth_images

            started = time.perf_counter()
            data = synth_images(work / "data", 1, classes=10, per_class=p.per_class,
                                test_fraction=HELD_OUT_PER_CLASS / p.per_class)[0]
            _log(f"synthetic data: {p.per_class * 10} images in "
                 f"{time.perf_counter() - started:.1f}s")
        _log(f"plain loop, {p.seconds:g}s on {device}")
        base = run_plain(p, device, data)
        _log(f"plain: {base['steps']} steps, {base['images_per_s']:.0f} images/s")
        _log(f"fedgpu: {p.rounds} round(s) of {base['steps']} steps")
        fed = run_fedgpu(p, device, data, base["steps"], work)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            for name in ("aggregator.log", "node.log", "job.toml"):
                shutil.copy(work / name, a.out / name)
    last = fed["rounds"][-1]
    doc = {
        "device": device, "device_name": base["device_name"], "torch": base["torch"],
        "preset": asdict(p), "plain": base, "fedgpu": fed,
        "loop_ratio": round(last["loop_images_per_s"] / base["images_per_s"], 4),
        "round_ratio": round(last["round_images_per_s"] / base["images_per_s"], 4),
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
    }
    if a.out:
        (a.out / "gpu_throughput.json").write_text(json.dumps(doc, indent=1))
    _log(f"fedgpu round {last['round']}: loop {last['loop_images_per_s']:.0f} images/s "
         f"({100 * doc['loop_ratio']:.1f}% of plain), whole round "
         f"{last['round_images_per_s']:.0f} images/s ({100 * doc['round_ratio']:.1f}%), "
         f"overhead {last['overhead_s']:.2f}s, first step {last['first_step_s']:.2f}s")
    emit(doc)


def _log(msg: str) -> None:
    print(f"[gpu_throughput {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
