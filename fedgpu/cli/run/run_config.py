"""What `fedgpu run` is asked for: the job it runs (a `Job`, from a job file or built here as the
demo job) and the knobs of the local federation around it (LocalRunConfig: node count,
partitioning, processes). The job's own keys and defaults are the job schema's
(fedgpu/core/job/); nothing here copies them."""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedgpu.core.job import Job, parse_job


def demo_job(*, task: str = "digits", nodes: int = 3, rounds: int = 5, fraction: float = 1.0,
             min_nodes: int | None = None, seed: int = 0, use_gpu: bool = True,
             hyperparameters: dict[str, Any] | None = None, mode: str = "star",
             iterations: int | None = None, local_steps: int = 1) -> Job:
    """The job `fedgpu run` runs without --job: the task's demo hyperparameters, how many
    updates close a round for this many nodes, ring blocks; every other key the schema's
    default. Checked by the schema like any job file."""
    from fedgpu.cli.run.data import DEFAULT_HPARAMS

    raw: dict[str, Any] = {
        "task": task, "rounds": rounds, "min_nodes": needed(nodes, fraction, min_nodes),
        "fraction": fraction, "use_gpu": use_gpu, "seed": seed,
        "hyperparameters": {**DEFAULT_HPARAMS.get(task, {}), **(hyperparameters or {})},
    }
    if mode != "star":
        # One epoch of the node's share per block by default, like a star round of
        # local_epochs=1 (digits: about 1440 training examples split over the nodes, batches
        # of 32).
        per_epoch = -(-1440 // max(nodes, 1) // 32)
        raw.update(mode=mode, iterations=iterations or rounds * per_epoch,
                   local_steps=local_steps)
    return parse_job(raw, "fedgpu run")


def needed(nodes: int, fraction: float = 1.0, given: int | None = None) -> int:
    """The fewest updates that close a round of the demo job: all nodes when all train, else
    half of those sampled (a node that fails costs its update, not the whole round's)."""
    if given is not None:
        return given
    if fraction >= 1.0:
        return nodes
    sampled = math.ceil(round(fraction * nodes, 9))
    return max(1, sampled // 2)


@dataclass
class LocalRunConfig:
    # The job to run, and the file it came from (its task_dir and initial_weights are
    # relative to it); without a file, the demo job.
    job: Job = field(default_factory=demo_job)
    job_file: Path | None = None
    nodes: int = 3
    run_dir: Path | None = None
    partition: str = "iid"
    alpha: float = 0.5
    # Seeds the data split (the demo job's own seed is its `seed` key).
    split_seed: int = 0
    gpu: str = "offer"
    gpu_memory_fraction: float | None = None
    # CPU rounds training at once on this host (0: one per core), and nodes per agent process.
    cpu_slots: int = 0
    nodes_per_process: int = 50
    timeout_s: float = 1800.0
    torch_threads: int = 1
    node_env: dict[str, str] = field(default_factory=dict)
    # An existing split to train on instead of the data made for the job's task
    # (fedgpu/cli/run/data.py).
    data: Path | None = None
    # Each job as an MLflow run there (`server start --tracking-uri`); None: off.
    tracking_uri: str | None = None
    # After the training job, a cross-site job of it (fedgpu/cli/run/cross_site.py).
    cross_site: bool = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
