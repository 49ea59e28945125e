"""What `fedgpu run` is asked for (LocalRunConfig) and the job file it writes from that for its
local federation: the demo task's defaults, how many updates close a round, ring blocks."""

from __future__ import annotations

import json
import math
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class LocalRunConfig:
    nodes: int = 3
    rounds: int = 5
    run_dir: Path | None = None
    job: Path | None = None
    partition: str = "iid"
    alpha: float = 0.5
    seed: int = 0
    use_gpu: bool = True
    gpu: str = "offer"
    gpu_memory_fraction: float | None = None
    round_deadline_s: float = 300.0
    # Share of the nodes sampled each round, and the fewest updates that close a round (None:
    # all nodes when every node trains, else half of those sampled).
    fraction: float = 1.0
    min_nodes: int | None = None
    # CPU rounds training at once on this host (0: one per core), and nodes per agent process.
    cpu_slots: int = 0
    nodes_per_process: int = 50
    timeout_s: float = 1800.0
    torch_threads: int = 1
    node_env: dict[str, str] = field(default_factory=dict)
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    # "ring": D-PSGD over torch.distributed instead of FedAvg; rounds are blocks of iterations.
    mode: str = "star"
    iterations: int | None = None
    local_steps: int = 1
    # The demo job's task (ignored with `job`), and an existing split to train on instead of
    # the data made for that task (fedgpu/cli/run/data.py).
    task: str = "digits"
    data: Path | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_toml(cfg: LocalRunConfig) -> str:
    from fedgpu.cli.run.data import DEFAULT_HPARAMS

    hp = {**DEFAULT_HPARAMS.get(cfg.task, {}), **cfg.hyperparameters}
    lines = [
        f"task = {json.dumps(cfg.task)}",
        f"rounds = {cfg.rounds}",
        f"min_nodes = {min_nodes(cfg)}",
        f"fraction = {cfg.fraction}",
        f"round_deadline_s = {cfg.round_deadline_s}",
        f"use_gpu = {'true' if cfg.use_gpu else 'false'}",
        f"seed = {cfg.seed}",
        *_ring_lines(cfg),
        "",
        "[hyperparameters]",
        *(f"{k} = {json.dumps(v)}" for k, v in hp.items()),
    ]
    return "\n".join(lines) + "\n"


def min_nodes(cfg: LocalRunConfig) -> int:
    if cfg.min_nodes is not None:
        return cfg.min_nodes
    if cfg.fraction >= 1.0:
        return cfg.nodes
    # A node that fails (or whose agent dies) costs that node's update, not the whole round's.
    sampled = math.ceil(round(cfg.fraction * cfg.nodes, 9))
    return max(1, sampled // 2)


def _ring_lines(cfg: LocalRunConfig) -> list[str]:
    if cfg.mode == "star":
        return []
    # One epoch of the node's share per block by default, like a star round of local_epochs=1
    # (digits: about 1440 training examples split over the nodes, batches of 32).
    per_epoch = -(-1440 // max(cfg.nodes, 1) // 32)
    iterations = cfg.iterations or cfg.rounds * per_epoch
    return [f'mode = "{cfg.mode}"', f"iterations = {iterations}",
            f"local_steps = {cfg.local_steps}"]
