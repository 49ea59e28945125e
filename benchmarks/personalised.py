"""Per-site accuracy of FedAvg, personalised heads (FedPer) and FedBN on label-skewed splits
(job key local_params; docs/how-to/personalised-layers.md).

The federation is simulated in one process with fedgpu's own parts and no network, as
benchmarks/dp_utility.py does: each site's round is `fedgpu.node.rounds.runner.run_round` (the
code a node's worker runs, with the site's local layers kept in a state directory of its own,
node/rounds/local_state.py), the aggregate is `fedgpu.server.strategies` FedAvg over the shared
tensors, and the global model keeps its own copy of the local ones, as the aggregator's engine
does. Same split, initial model, rounds and seeds for every row; only `local_params` differs.

Splits: the packaged digits, Dirichlet label skew (`fedgpu data split --partition dirichlet`);
the images task on synthetic images, the same skew (`fedgpu data split-folder --partition
dirichlet`). Accuracy is each site's on its own held-out split, with its own local layers (for
FedAvg: the global model), after the last round.

Run: `python -m benchmarks.personalised [--nodes 4 --rounds 5 --alpha 0.3 --out FILE]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core import codec, local_params
from fedgpu.core.datasets import split_digits
from fedgpu.core.imagefolders import split_folder
from fedgpu.core.synth_images import synth_images
from fedgpu.node import weights
from fedgpu.node.rounds import runner
from fedgpu.node.rounds.workfiles import WEIGHTS_IN, WEIGHTS_OUT
from fedgpu.server.strategies import make_strategy
from fedgpu.server.strategies.update import UpdateIn

HP: dict[str, dict[str, Any]] = {
    "digits": {"lr": 0.05, "local_epochs": 1},
    # A small ResNet on 16x16 images: minutes on a CPU, with BatchNorm layers for FedBN.
    "images": {"depth": 8, "width": 8, "image_size": 16, "batch_size": 32, "lr": 0.05},
}
METHODS: dict[str, dict[str, tuple[str, ...] | None]] = {
    "digits": {"fedavg": (), "personal head (fc2.*)": ("fc2.*",),
               "fedbn": None},  # no BatchNorm in the digits CNN
    "images": {"fedavg": (), "personal head (fc.*)": ("fc.*",),
               "fedbn": local_params.FEDBN},
}


def _spec(kind: str, node: Path | None, hp: dict[str, Any], seed: int, number: int,
          task: str, state: Path | None = None) -> runner.RoundSpec:
    return runner.parse_spec({
        "kind": kind, "task_name": task, "hyperparameters": hp, "seed": seed,
        "round": number, "data_dir": str(node) if node else None, "device": "cpu",
        "memory_fraction": None, "torch_threads": 1,
        **({"local_state_dir": str(state)} if state is not None else {})})


def splits(work: Path, nodes: int, alpha: float, seed: int) -> dict[str, list[Path]]:
    digits = split_digits(work / "digits", nodes, "dirichlet", alpha, seed)
    pool = synth_images(work / "pool", 1, classes=10, per_class=80, size=16, seed=seed)[0]
    images = split_folder(pool, work / "images", nodes, "dirichlet", alpha, seed)
    return {"digits": digits, "images": images}


def run(task: str, nodes: list[Path], patterns: tuple[str, ...], rounds: int, seed: int,
        work: Path) -> list[float]:
    """Each site's accuracy after `rounds` rounds with these local patterns."""
    hp = dict(HP[task])
    if patterns:
        hp.update({local_params.HPARAM: list(patterns), local_params.RUN_HPARAM: "bench"})
    states = [work / f"site-{i}" for i in range(len(nodes))]
    strategy = make_strategy("fedavg", {}, None, rounds)
    runner.run_round(_spec("init", None, HP[task], seed, 0, task), work)
    global_ = codec.decode((work / WEIGHTS_OUT).read_bytes())[0]
    for number in range(1, rounds + 1):
        strategy.begin_round(local_params.shared(global_, patterns))
        for i, node in enumerate(nodes):
            weights.write_weights(work / WEIGHTS_IN, global_)
            res = runner.run_round(_spec("train", node, hp, seed * 1000 + number * 10 + i,
                                         number, task, states[i]), work)
            strategy.add(UpdateIn(codec.decode((work / WEIGHTS_OUT).read_bytes())[0],
                                  res.num_examples))
        global_ = {**global_, **{k: np.array(v) for k, v in strategy.finish().items()}}
        strategy.commit()
    out = []
    for i, node in enumerate(nodes):
        weights.write_weights(work / WEIGHTS_IN, global_)
        res = runner.run_round(_spec("evaluate", node, hp, 0, rounds + 1, task, states[i]),
                               work)
        out.append(res.eval_metrics["accuracy"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/personalised_results.json"))
    args = ap.parse_args()
    rows = []
    started = time.time()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        data = splits(Path(tmp), args.nodes, args.alpha, args.seed)
        for task, methods in METHODS.items():
            for name, patterns in methods.items():
                if patterns is None:
                    rows.append({"task": task, "method": name, "sites": None,
                                 "note": "no BatchNorm layer in this model"})
                    continue
                work = Path(tmp) / f"{task}-{name.split()[0]}"
                work.mkdir()
                t0 = time.time()
                accs = run(task, data[task], patterns, args.rounds, args.seed, work)
                rows.append({"task": task, "method": name, "sites": [round(a, 4) for a in accs],
                             "mean": round(statistics.mean(accs), 4),
                             "min": round(min(accs), 4), "seconds": round(time.time() - t0, 1)})
                print(json.dumps(rows[-1]), flush=True)
    doc = {"machine": f"{platform.node()} ({platform.processor() or platform.machine()}, "
                      f"{os.cpu_count()} cores)",
           "load_at_start": [round(x, 2) for x in load],
           "load_at_end": [round(x, 2) for x in os.getloadavg()],
           "nodes": args.nodes, "rounds": args.rounds, "alpha": args.alpha, "seed": args.seed,
           "seconds": round(time.time() - started, 1), "rows": rows}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}))


if __name__ == "__main__":
    main()
