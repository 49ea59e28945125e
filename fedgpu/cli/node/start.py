"""`fedgpu node start`: the training agent, what the node container runs."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.common.options import TlsCa, TlsCert, TlsKey
from fedgpu.cli.node.options import STATUS_HELP, StateDirOpt, TaskApprovalOpt
from fedgpu.core import lifetime, logs
from fedgpu.core.constants import DEFAULT_RING_PORT, NODE_STATUS_FILE, TaskApproval
from fedgpu.core.errors import ConfigError, FedgpuError
from fedgpu.core.slots import MAX_SLOTS


def start(
    aggregator: Annotated[str | None, typer.Option(
        envvar="FEDGPU_AGGREGATOR", show_default=False,
        help="Aggregator address HOST:PORT (required, unless the --kit has it).")] = None,
    data: Annotated[Path | None, typer.Option(
        envvar="FEDGPU_DATA", show_default=False,
        help="This node's data directory (from 'fedgpu data split'; required, unless the "
             "--kit has it).")] = None,
    kit: Annotated[Path | None, typer.Option(
        envvar="FEDGPU_NODE_KIT",
        help="A site's startup kit ('fedgpu kit site NAME'): the aggregator's address, the "
             "site's name, certificate and CA, and its data, GPU policy and site policy "
             "(policy.toml) when the kit has them. A flag given here wins over the kit's "
             "value.")] = None,
    name: Annotated[str | None, typer.Option(
        envvar="FEDGPU_NODE_NAME",
        help="Node name (default: the --tls-cert's name, else the hostname and a short id kept "
             "in the state directory, one per agent).")] = None,
    token: Annotated[str | None, typer.Option(
        envvar="FEDGPU_TOKEN", help="The aggregator's token.")] = None,
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="Connect without a token (aggregator must run --insecure).")] = False,
    gpu: Annotated[str | None, typer.Option(
        envvar="FEDGPU_GPU", show_default="offer",
        help="GPU policy: none, offer or enforce.")] = None,
    gpu_index: Annotated[str | None, typer.Option(
        envvar="FEDGPU_GPU_INDEX", help="Preferred GPU: NVML index or UUID.")] = None,
    gpu_min_free_mib: Annotated[int, typer.Option(
        envvar="FEDGPU_GPU_MIN_FREE_MIB", help="A GPU needs this much free memory.")] = 0,
    gpu_memory_fraction: Annotated[float | None, typer.Option(
        envvar="FEDGPU_GPU_MEMORY_FRACTION",
        help="Cap the training process to this share of the GPU, in (0, 1].")] = None,
    connect_timeout: Annotated[float, typer.Option(
        help="Seconds to keep trying to reach the aggregator at start.")] = 60.0,
    max_task_mib: Annotated[int, typer.Option(
        envvar="FEDGPU_MAX_TASK_MIB", min=0,
        help="Largest task payload (the global model) this node accepts, in MiB; a larger task "
             "is reported to the aggregator as failed. 0: the aggregator's --max-update-mib.")
    ] = 0,
    prestart: Annotated[bool, typer.Option(
        "--prestart/--no-prestart", envvar="FEDGPU_PRESTART",
        help="Fork each round's training process from a worker factory that imported torch "
             "ahead of time (CUDA untouched), so a round does not pay the start-up; "
             "--no-prestart spawns a fresh process per round.")] = True,
    worker_factory: Annotated[Path | None, typer.Option(
        envvar="FEDGPU_WORKER_FACTORY",
        help="Socket of this host's shared worker factory ('fedgpu node factory'); default: "
             "the agent starts a factory of its own.")] = None,
    torch_threads: Annotated[int | None, typer.Option(
        envvar="FEDGPU_TORCH_THREADS", help="CPU threads for training.")] = None,
    status_file: Annotated[Path, typer.Option(
        envvar="FEDGPU_NODE_STATUS", help=STATUS_HELP)] = Path(NODE_STATUS_FILE),
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    ring_host: Annotated[str, typer.Option(
        envvar="FEDGPU_RING_HOST",
        help="Ring mode: address peers use to reach this node's worker (default: the address "
             "the aggregator sees).")] = "",
    ring_port: Annotated[int, typer.Option(
        envvar="FEDGPU_RING_PORT",
        help="Ring mode: TCP port of the rendezvous this node hosts when it is rank 0.")
    ] = DEFAULT_RING_PORT,
    task_approval: TaskApprovalOpt = TaskApproval.APPROVED,
    state_dir: StateDirOpt = None,
    policy_file: Annotated[Path | None, typer.Option(
        "--policy", envvar="FEDGPU_NODE_POLICY", show_default=False,
        help="The site's policy (TOML): the studies, tasks and job terms this site trains "
             "for (docs: how-to/site-policies.md). Every task is checked against it here; "
             "the aggregator only sees it.")] = None,
    secagg_min_threshold: Annotated[int, typer.Option(
        envvar="FEDGPU_SECAGG_MIN_THRESHOLD", min=0,
        help="Secure aggregation: refuse a round whose threshold (shares needed to rebuild a "
             "secret) is below this count, on top of the strict majority of its shareholders "
             "every site demands. 0: the majority only.")] = 0,
    slots: Annotated[int, typer.Option(
        envvar="FEDGPU_NODE_SLOTS", min=1, max=MAX_SLOTS,
        help="Round tasks of different jobs this site runs at once, each in its own worker "
             "process and each admitted to a GPU on its own (both must fit its memory "
             "policy); the aggregator lets that many running jobs use the site.")] = 1,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "INFO",
) -> None:
    """Start a training node: register with the aggregator and serve its tasks.

    Example: fedgpu node start --aggregator agg.example.org:50051 --data data/node-1 --name site-a

    Example: fedgpu node start --kit kits/site-a
    """
    from fedgpu.core import certs, tls
    from fedgpu.node import policy
    from fedgpu.node.agent import Agent
    from fedgpu.node.agent_config import AgentConfig
    from fedgpu.node.data import DataDirError, check_data_dir

    logs.setup(log_level)
    if kit is not None:
        from fedgpu.cli.kit.files import read_node_kit

        k = read_node_kit(kit)
        aggregator, data, name = aggregator or k.aggregator, data or k.data, name or k.name
        gpu = gpu or k.gpu
        policy_file = policy_file or k.policy
        if not (tls_cert or tls_key or tls_ca):
            tls_cert, tls_key, tls_ca = k.tls_cert, k.tls_key, k.tls_ca
    if aggregator is None:
        raise ConfigError("no aggregator: pass --aggregator HOST:PORT (or FEDGPU_AGGREGATOR), "
                          "or --kit DIR with a site's startup kit")
    if data is None:
        raise ConfigError("no data directory: pass --data DIR (or FEDGPU_DATA), or a --kit "
                          "made with 'fedgpu kit site NAME --data DIR'")
    # Read before the data directory is checked: a bad policy file (a kit's policy.toml the
    # site edited, say) is named before anything else about the host.
    site_policy = None
    if policy_file is not None:
        from fedgpu.core import site_policy as sp

        site_policy = sp.load(policy_file)
        task_approval = sp.stricter_approval(task_approval, site_policy.task_approval)
        logging.getLogger("fedgpu.node").info("site policy %s: %s (--task-approval %s)",
                                              policy_file, site_policy.summary(),
                                              task_approval)
    try:
        flags = policy.parse_gpu_flags(gpu or "offer", gpu_index, gpu_min_free_mib,
                                       gpu_memory_fraction)
    except policy.PolicyError as exc:
        raise ConfigError(str(exc)) from None
    tls_files = tls.from_options(tls_cert, tls_key, tls_ca)
    if not insecure and not token and not (tls_files and tls_files.mutual):
        raise ConfigError("no token: pass --token (or set FEDGPU_TOKEN) to the aggregator's "
                          "token, --tls-cert/--tls-key/--tls-ca for mutual TLS, or --insecure "
                          "if the aggregator runs without either")
    if name is None and tls_files is not None and tls_files.cert is not None:
        # The aggregator accepts only the certificate's own name, so that is the default.
        name = certs.identity(tls_files.cert.read_bytes())
    if ":" not in aggregator:
        raise ConfigError(f"--aggregator {aggregator!r} must be HOST:PORT (e.g. localhost:50051)")
    try:
        check_data_dir(data)
    except DataDirError as exc:
        raise ConfigError(str(exc)) from None
    agent = Agent(AgentConfig(
        aggregator=aggregator,
        data_dir=data,
        name=name,
        token=None if insecure else token,
        gpu=flags,
        connect_timeout_s=connect_timeout,
        **({"max_payload_bytes": max_task_mib << 20} if max_task_mib else {}),
        status_file=status_file,
        torch_threads=torch_threads,
        prestart=prestart,
        worker_factory=worker_factory,
        tls=tls_files,
        ring_host=ring_host,
        ring_port=ring_port,
        task_approval=task_approval,
        state_dir=state_dir,
        secagg_min_threshold=secagg_min_threshold,
        site_policy=site_policy,
        slots=slots,
    ))

    def on_signal(signum: int, _frame: object) -> None:
        lifetime.exit_within(lifetime.STOP_LIMIT_S,
                             0 if signum == signal.SIGTERM else lifetime.exit_code(signum))
        agent.stop()
        # Raised where the main thread is (waiting on a training child or a long poll): the
        # round code kills the child on the way out, so no orphan keeps the GPU.
        raise Shutdown(signum)

    # SIGINT too, explicitly: started in the background by a script it was ignored.
    lifetime.handle_signals(on_signal)
    try:
        code = agent.run()
    except policy.EnforceError as exc:
        raise FedgpuError(str(exc)) from None
    except Shutdown as stop:
        logging.getLogger("fedgpu.node").info("%s: stopped (any training child killed)",
                                              signal.Signals(stop.signum).name)
        # SIGTERM is how a container or `fedgpu run` stops a node: a clean exit.
        code = 0 if stop.signum == signal.SIGTERM else lifetime.exit_code(stop.signum)
    raise typer.Exit(code)


class Shutdown(BaseException):
    """A stop signal: unwinds the agent from wherever it is blocked. A BaseException so that
    no `except Exception` on the way (retry loops, task error handling) swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
