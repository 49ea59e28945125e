"""`fedgpu node start-many`: many nodes in one agent process."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.node.options import StateDirOpt, TaskApprovalOpt
from fedgpu.core import lifetime, logs
from fedgpu.core.constants import TaskApproval
from fedgpu.core.datasets import NODE_DIR_PREFIX
from fedgpu.core.errors import ConfigError

# The agent lines of a process that hosts many nodes say which node wrote them.
MANY_FORMAT = "%(asctime)s %(levelname)-7s %(name)s [%(threadName)s]: %(message)s"


def start_many(
    aggregator: Annotated[str, typer.Option(help="Aggregator address HOST:PORT.")],
    split: Annotated[Path, typer.Option(
        help=f"Directory holding the nodes' data directories {NODE_DIR_PREFIX}1 .. "
             f"{NODE_DIR_PREFIX}N (as 'fedgpu data split' writes them).")],
    count: Annotated[int, typer.Option(min=1, help="How many nodes this process hosts.")],
    first: Annotated[int, typer.Option(min=1, help="Number of the first of them.")] = 1,
    name_prefix: Annotated[str, typer.Option(
        help="Node I is named PREFIX+I (and reads SPLIT/node-I).")] = "node-",
    token: Annotated[str | None, typer.Option(
        envvar="FEDGPU_TOKEN", help="The aggregator's token.")] = None,
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="Connect without a token (aggregator must run --insecure).")] = False,
    gpu: Annotated[str, typer.Option(help="GPU policy of every node: none, offer or enforce.")
                   ] = "offer",
    gpu_index: Annotated[str | None, typer.Option(help="Preferred GPU: NVML index or UUID.")
                         ] = None,
    gpu_min_free_mib: Annotated[int, typer.Option(help="A GPU needs this much free memory.")
                                ] = 0,
    gpu_memory_fraction: Annotated[float | None, typer.Option(
        help="Cap each round's training process to this share of its GPU, in (0, 1]; also "
             "how many of them share a card at once (slots).")] = None,
    prestart: Annotated[bool, typer.Option(
        "--prestart/--no-prestart", envvar="FEDGPU_PRESTART",
        help="Fork round workers from a worker factory (torch imported once, CUDA untouched); "
             "--no-prestart spawns a fresh process per round.")] = True,
    worker_factory: Annotated[Path | None, typer.Option(
        help="Socket of this host's worker factory ('fedgpu node factory'); default: the "
             "process starts one for its nodes.")] = None,
    cpu_slots: Annotated[int, typer.Option(
        min=0, help="With a factory of its own: CPU rounds training at once (0: one per "
                    "core).")] = 0,
    torch_threads: Annotated[int | None, typer.Option(help="CPU threads for training.")] = None,
    status_dir: Annotated[Path | None, typer.Option(
        help="Write each node's status file NAME.status.json here.")] = None,
    log_dir: Annotated[Path | None, typer.Option(
        help="Write each node's log (its agent's lines and its workers' output) to "
             "NAME.log here.")] = None,
    ring_host: Annotated[str, typer.Option(
        help="Ring mode: address peers use to reach these nodes' workers.")] = "",
    ring_ports: Annotated[str, typer.Option(
        help="Ring mode: one rendezvous port per node, comma-separated.")] = "",
    connect_timeout: Annotated[float, typer.Option(
        help="Seconds to keep trying to reach the aggregator at start.")] = 60.0,
    max_task_mib: Annotated[int, typer.Option(
        min=0, help="Largest task payload a node accepts, in MiB (0: the aggregator's).")] = 0,
    task_approval: TaskApprovalOpt = TaskApproval.APPROVED,
    state_dir: StateDirOpt = None,
    policy_file: Annotated[Path | None, typer.Option(
        "--policy", show_default=False,
        help="One site policy (TOML) for every node here (docs: how-to/site-policies.md); "
             "`fedgpu run --cross-site` gives its nodes share_local_model = true.")] = None,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "INFO",
) -> None:
    """Host COUNT training nodes in this one process (token authentication only).

    Each node is a whole agent — its own name, data directory, registration, GPU decision and
    reports — in a thread; they share the process and one worker factory.

    Example: fedgpu node start-many --aggregator localhost:50051 --split data --count 10
    """
    from fedgpu.node import policy
    from fedgpu.node.agent_config import AgentConfig
    from fedgpu.node.data import DataDirError, check_data_dir
    from fedgpu.node.fleet import Fleet
    from fedgpu.node.rounds.factory_client import FactoryClient

    logs.setup(log_level)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(MANY_FORMAT))
    try:
        flags = policy.parse_gpu_flags(gpu, gpu_index, gpu_min_free_mib, gpu_memory_fraction)
    except policy.PolicyError as exc:
        raise ConfigError(str(exc)) from None
    if not insecure and not token:
        raise ConfigError("no token: pass --token (or set FEDGPU_TOKEN), or --insecure if the "
                          "aggregator runs without one")
    if ":" not in aggregator:
        raise ConfigError(f"--aggregator {aggregator!r} must be HOST:PORT")
    site_policy = None
    if policy_file is not None:
        from fedgpu.core import site_policy as sp

        site_policy = sp.load(policy_file)
        task_approval = sp.stricter_approval(task_approval, site_policy.task_approval)
    numbers = range(first, first + count)
    ports = _ports(ring_ports, count)
    configs = []
    for i, number in enumerate(numbers):
        data = split / f"{NODE_DIR_PREFIX}{number}"
        try:
            check_data_dir(data)
        except DataDirError as exc:
            raise ConfigError(str(exc)) from None
        name = f"{name_prefix}{number}"
        configs.append(AgentConfig(
            aggregator=aggregator, data_dir=data, name=name,
            token=None if insecure else token, gpu=flags, connect_timeout_s=connect_timeout,
            **({"max_payload_bytes": max_task_mib << 20} if max_task_mib else {}),
            status_file=status_dir / f"{name}.status.json" if status_dir else None,
            torch_threads=torch_threads, prestart=prestart, worker_factory=worker_factory,
            ring_host=ring_host, **({"ring_port": ports[i]} if ports else {}),
            task_approval=task_approval, state_dir=state_dir, site_policy=site_policy,
        ))
    if status_dir is not None:
        status_dir.mkdir(parents=True, exist_ok=True)
    factory = None
    if prestart:
        # One factory for all of this process's nodes, unless the host shares one.
        factory = (FactoryClient(worker_factory) if worker_factory is not None
                   else FactoryClient.start_own(cpu_slots=cpu_slots))
    fleet = Fleet(configs, factory, log_dir)
    fleet.install_logs(logging.Formatter(logs.FORMAT))
    stop = threading.Event()
    stopped_by: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        if not stopped_by:
            lifetime.exit_within(lifetime.STOP_LIMIT_S, _stop_code(signum))
        stopped_by.append(signum)
        stop.set()

    lifetime.handle_signals(on_signal)
    try:
        code = fleet.run(stop)
    finally:
        fleet.close()
    if stopped_by:
        logging.getLogger("fedgpu.node").info(
            "%s: stopped %d nodes (any training child killed)",
            signal.Signals(stopped_by[0]).name, count)
        code = _stop_code(stopped_by[0])
    raise typer.Exit(code)


def _stop_code(signum: int) -> int:
    # SIGTERM is how `fedgpu run` stops its nodes: a clean exit.
    return 0 if signum == signal.SIGTERM else lifetime.exit_code(signum)


def _ports(raw: str, count: int) -> list[int]:
    if not raw:
        return []
    try:
        ports = [int(p) for p in raw.split(",")]
    except ValueError:
        raise ConfigError(f"--ring-ports takes comma-separated port numbers, got {raw!r}"
                          ) from None
    if len(ports) != count or not all(0 < p < 65536 for p in ports):
        raise ConfigError(f"--ring-ports needs {count} ports in 1..65535, got {raw!r}")
    return ports
