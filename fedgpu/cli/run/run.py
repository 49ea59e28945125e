"""`fedgpu run`: a whole federation on this machine, no Docker."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedgpu.core.constants import PARTITIONS
from fedgpu.core.errors import ConfigError


def run(
    nodes: Annotated[int, typer.Option(help="Number of local nodes.")] = 3,
    rounds: Annotated[int, typer.Option(help="Federated rounds.")] = 5,
    job: Annotated[Path | None, typer.Option(help="Job file; default: digits demo job.")] = None,
    run_dir: Annotated[Path | None, typer.Option(
        help="Where data, logs and checkpoints go (default runs/<time>).")] = None,
    partition: Annotated[str, typer.Option(help="iid or dirichlet.")] = "iid",
    alpha: Annotated[float, typer.Option(help="Dirichlet concentration (non-IID).")] = 0.5,
    seed: Annotated[int, typer.Option(help="Seed for data split and sampling.")] = 0,
    gpu: Annotated[str, typer.Option(help="Node GPU policy: none, offer, enforce.")] = "offer",
    gpu_memory_fraction: Annotated[float | None, typer.Option(
        help="Cap each node's training process to this share of its GPU.")] = None,
    use_gpu: Annotated[bool, typer.Option("--use-gpu/--no-use-gpu",
                                          help="Whether the job asks for GPUs.")] = True,
    local_epochs: Annotated[int, typer.Option(help="Local epochs per round.")] = 1,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 1800.0,
    torch_threads: Annotated[int, typer.Option(help="CPU threads per node.")] = 1,
    mode: Annotated[str, typer.Option(
        help="star (FedAvg at the aggregator) or ring (D-PSGD gossip between the nodes).")
    ] = "star",
    iterations: Annotated[int | None, typer.Option(
        help="Ring mode: gradient steps per node in all (default: one epoch per round).")
    ] = None,
    local_steps: Annotated[int, typer.Option(
        help="Ring mode: gradient steps between two gossip exchanges.")] = 1,
    task: Annotated[str, typer.Option(
        help="Task of the demo job (ignored with --job): digits (packaged data) or images "
             "(synthetic 32x32 images, ResNet-20 unless --hp depth=...).")] = "digits",
    data: Annotated[Path | None, typer.Option(
        help="Train on this existing split (node-1 .. node-N, as 'fedgpu data ...' writes) "
             "instead of making one.")] = None,
    hp: Annotated[list[str] | None, typer.Option(
        "--hp", help="Hyperparameter of the demo job, KEY=VALUE (repeatable), e.g. --hp "
                     "depth=18 --hp amp=bf16.")] = None,
    fraction: Annotated[float | None, typer.Option(
        help="Share of the nodes sampled each round, in (0, 1] (demo job; default 1).")] = None,
    min_nodes: Annotated[int | None, typer.Option(
        help="Fewest updates that close a round (demo job; default: every node when all "
             "train, else half of those sampled).")] = None,
    cpu_slots: Annotated[int, typer.Option(
        min=0, help="CPU rounds training at once on this machine; more sampled nodes wait "
                    "for a slot (0: one per core).")] = 0,
    nodes_per_process: Annotated[int, typer.Option(
        min=1, help="Nodes hosted by one agent process.")] = 50,
    tracking_uri: Annotated[str | None, typer.Option(
        envvar="FEDGPU_TRACKING_URI",
        help="Record the job as an MLflow run there (sqlite:///PATH, file:PATH or a tracking "
        "server's URI), with the report's plots; needs fedgpu[tracking].")] = None,
    cross_site: Annotated[bool, typer.Option(
        "--cross-site", help="After the training job, a cross-site job of it (mode = "
        "\"cross-site\"): the global model and each node's local model scored on every "
        "node's held-out data; the nodes here share their local models.")] = False,
) -> None:
    """Run an aggregator and N nodes as local processes and show each round.

    Example: fedgpu run --nodes 3 --rounds 5 --gpu none
    """
    from fedgpu.cli.run.data import parse_hparams
    from fedgpu.cli.run.launcher import LocalRunConfig, demo_job, run_local
    from fedgpu.core.job import read_job_file
    from fedgpu.core.suggest import did_you_mean
    from fedgpu.node.policy import PolicyError, parse_gpu_flags
    from fedgpu.node.tasks import available_tasks

    try:
        parse_gpu_flags(gpu, None, 0, gpu_memory_fraction)
    except PolicyError as exc:
        raise ConfigError(str(exc)) from None
    if mode not in ("star", "ring"):
        raise ConfigError(f"--mode must be star or ring, not {mode!r}")
    if partition not in PARTITIONS:
        raise ConfigError(f"--partition must be one of {', '.join(PARTITIONS)}, not {partition!r}")
    if job is None and task not in available_tasks():
        raise ConfigError(f"--task {task!r} is not installed here"
                          f"{did_you_mean(task, available_tasks())} (installed: "
                          f"{', '.join(available_tasks())})")
    if job is not None and (fraction is not None or min_nodes is not None):
        raise ConfigError("--fraction and --min-nodes shape the demo job; with --job set "
                          "fraction and min_nodes in the job file")
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"--fraction must be in (0, 1], not {fraction}")
    if min_nodes is not None and not 1 <= min_nodes <= nodes:
        raise ConfigError(f"--min-nodes must be between 1 and --nodes ({nodes}), not {min_nodes}")
    if mode == "ring" and job is None and task != "digits":
        raise ConfigError(f"--mode ring needs a task with per-step hooks (RingTask in "
                          f"node/tasks/base.py); {task!r} is not one: use --mode star")
    if nodes < 1:
        raise ConfigError(f"--nodes must be at least 1, not {nodes}")
    # The job: the file's (read and checked by the job schema, as the aggregator will), or
    # the demo job these options shape.
    the_job = read_job_file(job).job if job is not None else demo_job(
        task=task, nodes=nodes, rounds=rounds, fraction=1.0 if fraction is None else fraction,
        min_nodes=min_nodes, seed=seed, use_gpu=use_gpu,
        hyperparameters={"local_epochs": local_epochs, **parse_hparams(hp or [])},
        mode=mode, iterations=iterations, local_steps=local_steps)
    if the_job.model_from_job is not None:
        raise ConfigError(f"{job}: 'model_from_job' names a job of a running aggregator, and "
                          "fedgpu run starts a fresh one: give that job's model (from 'fedgpu "
                          "job model') as 'initial_weights', or use 'fedgpu job submit' (for "
                          "mode = \"cross-site\": run the training job with --cross-site)")
    if cross_site:
        from fedgpu.cli.run.cross_site import check

        check(the_job)
    code = run_local(LocalRunConfig(
        job=the_job, job_file=job, nodes=nodes, run_dir=run_dir, partition=partition,
        alpha=alpha, split_seed=seed, gpu=gpu, gpu_memory_fraction=gpu_memory_fraction,
        timeout_s=timeout, torch_threads=torch_threads, data=data, cpu_slots=cpu_slots,
        nodes_per_process=nodes_per_process, tracking_uri=tracking_uri, cross_site=cross_site,
    ))
    raise typer.Exit(code)
