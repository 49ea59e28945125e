"""Accuracy against epsilon on digits (CPU): example-level DP-SGD and client-level central DP.

The federation is simulated in one process with fedgpu's own parts and no network: each node's
round is `fedgpu.node.rounds.runner.run_round` (the code a node's worker runs, Opacus
included), the aggregate is `fedgpu.server.strategies` (FedAvg, or the private wrapper that
clips, noises and accounts). Same data split, rounds and seeds for every row; only the privacy
settings differ. The noise is derived from the target epsilon for the whole run, so each row
spends at most its epsilon (at delta 1e-5):

- example-level: `dp_sgd`, `dp_target_epsilon = eps`, `dp_rounds = rounds` on every node; the
  reported epsilon is the largest `dp_epsilon_total` a node reported;
- client-level: `[privacy] mode = "central"`, `clip_norm`, `target_epsilon = eps`; the reported
  epsilon is the aggregator's account after the last round.

Also the time overhead of DP-SGD: the mean seconds of a node's training (train_seconds) with and
without it. Run: `python -m benchmarks.dp_utility [--nodes 10 --rounds 10 --out FILE]`.

`--flower` (digits; needs `make bench`'s .venv-bench) adds, for each client-level row, Flower's
central DP (benchmarks/flower_dp.py) with the same split, initial model, seeds, clip and the
noise multiplier fedgpu derived for that row: accuracy scored by the same code, epsilon by
Flower's own accountant.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core import codec
from fedgpu.core.datasets import split_digits
from fedgpu.core.privacy import parse_privacy
from fedgpu.core.synth_images import synth_images
from fedgpu.node import weights
from fedgpu.node.rounds import runner
from fedgpu.node.rounds.workfiles import WEIGHTS_IN, WEIGHTS_OUT
from fedgpu.server.strategies import make_strategy
from fedgpu.server.strategies.update import UpdateIn

HP = {"lr": 0.1, "local_epochs": 2, "batch_size": 32}
# `--task images`: a ResNet-8 of width 8 on 16x16 synthetic images (fedgpu data synth-images);
# under DP-SGD its BatchNorm layers become GroupNorm (dp_fix_model).
IMAGES_HP = {"lr": 0.05, "local_epochs": 1, "batch_size": 32, "depth": 8, "width": 8,
             "image_size": 16, "num_workers": 0}


@dataclass
class Row:
    level: str
    target: float
    epsilon: float
    accuracy: float
    train_s: float
    noise_multiplier: float
    # Rounds that ran before every node's training diverged on the noised model (the job
    # would have failed there); None: all of them.
    diverged_after: int | None = None


def _spec(kind: str, node_dir: Path, hp: dict[str, Any], seed: int,
          round_number: int, task: str = "digits") -> runner.RoundSpec:
    return runner.parse_spec({
        "kind": kind, "task_name": task, "hyperparameters": hp, "seed": seed,
        "round": round_number, "data_dir": str(node_dir), "device": "cpu",
        "memory_fraction": None, "torch_threads": 1})


def _evaluate(nodes: list[Path], global_: dict[str, np.ndarray], work: Path, task: str,
              hp: dict[str, Any]) -> float:
    right = seen = 0.0
    for node in nodes:
        weights.write_weights(work / WEIGHTS_IN, global_)
        res = runner.run_round(_spec("evaluate", node, hp, 0, 0, task), work)
        right += res.eval_metrics["accuracy"] * res.num_eval_examples
        seen += res.num_eval_examples
    return right / max(seen, 1)


def run(nodes: list[Path], rounds: int, level: str, eps: float, clip: float, seed: int,
        work: Path, task: str = "digits") -> Row:
    hp = dict(HP if task == "digits" else IMAGES_HP)
    privacy = None
    if level == "example" and math.isfinite(eps):
        hp.update(dp_sgd=True, dp_target_epsilon=eps, dp_rounds=rounds, max_grad_norm=1.0)
        if task == "images":
            hp["dp_fix_model"] = True
    if level == "client" and math.isfinite(eps):
        privacy = parse_privacy({"mode": "central", "clip_norm": clip, "target_epsilon": eps})
    strategy = make_strategy("fedavg", {}, privacy, rounds)
    runner.run_round(_spec("init", nodes[0], hp, seed, 0, task), work)
    global_ = codec.decode((work / WEIGHTS_OUT).read_bytes())[0]
    node_eps, train_s = [0.0], []
    noise = 0.0
    diverged = None
    for number in range(1, rounds + 1):
        strategy.begin_round(global_)
        added = 0
        for i, node in enumerate(nodes):
            weights.write_weights(work / WEIGHTS_IN, global_)
            try:
                res = runner.run_round(_spec("train", node, hp, seed * 1000 + number * 10 + i,
                                             number, task), work)
            except runner.DivergedError:
                continue  # a failed update, as in a federation
            added += 1
            train_s.append(res.train_seconds)
            node_eps.append(res.train_metrics.get("dp_epsilon_total", 0.0))
            noise = res.train_metrics.get("dp_noise_multiplier", noise)
            strategy.add(UpdateIn(codec.decode((work / WEIGHTS_OUT).read_bytes())[0],
                                  res.num_examples))
        if not added:
            diverged = number - 1
            break
        global_ = {k: np.array(v) for k, v in strategy.finish().items()}
        strategy.commit()
    epsilon = 0.0 if not math.isfinite(eps) else max(node_eps)
    if privacy is not None:
        epsilon = strategy.spent()  # type: ignore[attr-defined]
        noise = strategy.noise_multiplier  # type: ignore[attr-defined]
    acc = _evaluate(nodes, global_, work, task, hp)
    return Row(level, eps, epsilon, acc, statistics.mean(train_s or [0.0]), noise, diverged)


def run_flower(nodes: list[Path], rounds: int, row: Row, clip: float, seed: int,
               work: Path, init: dict[str, np.ndarray]) -> Row:
    """Flower's central DP with this client-level row's noise (benchmarks/flower_dp.py)."""
    from benchmarks.common import bench_python, run_case

    np.savez(work / "init.npz", **init)
    started = time.perf_counter()
    out = run_case("benchmarks.flower_dp", [
        "--split", str(nodes[0].parent), "--init", str(work / "init.npz"), "--nodes",
        str(len(nodes)), "--rounds", str(rounds), "--noise", repr(row.noise_multiplier),
        "--clip", str(clip), "--seed", str(seed), "--out", str(work / "flower.npz")],
        python=bench_python(), timeout=3600)
    with np.load(work / "flower.npz") as z:
        final = {k: z[k] for k in z.files}
    acc = _evaluate(nodes, final, work, "digits", dict(HP))
    return Row("flower-central", row.target, float(out["epsilon"]), acc,
               time.perf_counter() - started, row.noise_multiplier)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epsilons", default="1,3,8,inf")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--task", choices=("digits", "images"), default="digits")
    ap.add_argument("--flower", action="store_true",
                    help="also Flower's central DP beside each client-level row (digits)")
    ap.add_argument("--levels", default="example,client",
                    help="which rows: example, client or both (comma-separated)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.task == "digits":
            nodes = split_digits(Path(tmp) / "split", args.nodes, "iid", 0.5, args.seed)
        else:
            nodes = synth_images(Path(tmp) / "split", args.nodes, classes=10, per_class=40,
                                 size=16, seed=args.seed)
        work = Path(tmp) / "work"
        work.mkdir()
        rows = []
        for eps in [float(e) for e in args.epsilons.split(",")]:
            levels = args.levels.split(",")
            for level in ("example", "client"):
                if level not in levels:
                    continue
                if not math.isfinite(eps) and level == "client" and "example" in levels:
                    continue  # the same run as example-level without DP
                t0 = time.perf_counter()
                row = run(nodes, args.rounds, level, eps, args.clip, args.seed, work,
                          args.task)
                rows.append(row)
                if (args.flower and level == "client" and args.task == "digits"
                        and math.isfinite(eps)):
                    runner.run_round(_spec("init", nodes[0], dict(HP), args.seed, 0), work)
                    init = codec.decode((work / WEIGHTS_OUT).read_bytes())[0]
                    flower = run_flower(nodes, args.rounds, row, args.clip, args.seed, work,
                                        {k: np.asarray(v) for k, v in init.items()})
                    rows.append(flower)
                    print(f"flower   eps {eps:>4}: spent {flower.epsilon:.3f}, accuracy "
                          f"{flower.accuracy:.4f}, z {flower.noise_multiplier:.3f} "
                          f"({flower.train_s:.0f} s)", flush=True)
                print(f"{level:8s} eps {eps:>4}: spent {row.epsilon:.3f}, accuracy "
                      f"{row.accuracy:.4f}, z {row.noise_multiplier:.3f}, train "
                      f"{row.train_s:.3f} s/node-round, diverged after {row.diverged_after} "
                      f"({time.perf_counter() - t0:.0f} s)",
                      flush=True)
    doc = {"nodes": args.nodes, "rounds": args.rounds, "clip": args.clip, "seed": args.seed,
           "task": args.task, "hyperparameters": HP if args.task == "digits" else IMAGES_HP,
           "machine": f"{platform.machine()}, Python "
           f"{platform.python_version()}", "rows": [r.__dict__ for r in rows]}
    # Strict JSON: the row without DP has target null, not Infinity.
    text = json.dumps(doc, indent=2, default=str).replace(": Infinity", ": null")
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
