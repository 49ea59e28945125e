"""`fedgpu sim`: many simulated nodes in one process, for scale tests and benchmarks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.common.options import TlsCa, TlsCert, TlsKey
from fedgpu.core import logs, tls
from fedgpu.core.errors import ConfigError, FedgpuError


def sim(
    aggregator: Annotated[str, typer.Option(
        envvar="FEDGPU_AGGREGATOR", help="Aggregator address HOST:PORT.")],
    nodes: Annotated[int, typer.Option(help="Simulated nodes in this process.")] = 10,
    token: Annotated[str | None, typer.Option(
        envvar="FEDGPU_TOKEN", help="The aggregator's token.")] = None,
    prefix: Annotated[str, typer.Option(help="Node names are PREFIX-00000, ...")] = "sim",
    start_index: Annotated[int, typer.Option(
        help="First node number (to run several processes side by side).")] = 0,
    params: Annotated[int, typer.Option(
        help="Parameters of the synthetic model sent for an init task.")] = 1_000_000,
    tensors: Annotated[int, typer.Option(help="Tensors of the synthetic model.")] = 20,
    poll_s: Annotated[int, typer.Option(help="Long-poll wait per PullTask.")] = 25,
    nodes_per_channel: Annotated[int, typer.Option(
        help="Nodes sharing one connection (1 = one per node, like real sites).")] = 1,
    update_file: Annotated[Path | None, typer.Option(
        help="Send this safetensors file as every node's update (init and train), read from "
        "disk, and keep none of the models downloaded (their digest is still checked): "
        "big-model benchmarks within one machine's memory.")] = None,
    stats: Annotated[Path | None, typer.Option(
        help="Write registration/push/pull timings here as JSON.")] = None,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "INFO",
) -> None:
    """Run simulated nodes (real wire protocol, synthetic updates, no torch) until the
    aggregator says stop, or until SIGTERM / Ctrl-C. Like real nodes they wait out an
    aggregator restart and register again.

    Example: fedgpu sim --aggregator localhost:50051 --nodes 100 --token TOKEN
    """
    import grpc

    from fedgpu.node.sim.node import RegisterFailed
    from fedgpu.node.sim.records import SimConfig
    from fedgpu.node.sim.run import run_sim

    logs.setup(log_level)
    if nodes < 1 or params < tensors or tensors < 1:
        raise ConfigError("need --nodes >= 1 and --params >= --tensors >= 1")
    if update_file is not None and not update_file.is_file():
        raise ConfigError(f"--update-file {update_file} is not a file")
    cfg = SimConfig(aggregator=aggregator, token=token, nodes=nodes, prefix=prefix,
                    start_index=start_index, params=params, tensors=tensors, poll_s=poll_s,
                    nodes_per_channel=nodes_per_channel, stats_file=stats,
                    update_file=update_file, tls=tls.from_options(tls_cert, tls_key, tls_ca))
    try:
        result = asyncio.run(run_sim(cfg))
    except grpc.aio.AioRpcError as exc:
        raise FedgpuError(f"simulation stopped: {exc.code().name}: {exc.details()}") from None
    except RegisterFailed as exc:
        raise FedgpuError(str(exc)) from None
    typer.echo(json.dumps({"registered": result.registered, "tasks": result.tasks,
                           "errors": len(result.errors)}))
    raise typer.Exit(1 if result.errors else 0)
