"""`fedgpu server start`: what the aggregator container runs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.common.options import TlsCa, TlsCert, TlsKey
from fedgpu.core import logs
from fedgpu.core.codec import DEFAULT_CHUNK_SIZE
from fedgpu.core.job import read_job_file


def start(
    job: Annotated[Path | None, typer.Option(
        "--job", envvar="FEDGPU_JOB",
        help="Also queue this job file at start (once per state directory); without it the "
        "federation waits for 'fedgpu job submit'.")] = None,
    host: Annotated[str, typer.Option(
        help="Address the gRPC and bulk ports listen on: loopback unless you say otherwise "
        "(0.0.0.0 for every interface, as the containers do); plaintext on a non-loopback "
        "address is warned about.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="FEDGPU_PORT", help="gRPC port.")] = 50051,
    bulk_port: Annotated[int | None, typer.Option(
        envvar="FEDGPU_BULK_PORT", min=0, max=65535, show_default="the gRPC port + 1",
        help="TCP port of the bulk data path: model downloads and update uploads beside gRPC, "
        "at line rate (TLS as the gRPC port); nodes that cannot reach it use gRPC. Default: "
        "the gRPC port + 1 when free (compose and the Kubernetes manifests use 50052); 0 = "
        "off.")] = None,
    token: Annotated[str | None, typer.Option(
        envvar="FEDGPU_TOKEN", help="Shared token nodes must present.")] = None,
    operator_token: Annotated[str | None, typer.Option(
        envvar="FEDGPU_OPERATOR_TOKEN",
        help="Token operators present (job submit/stop, status, the dashboard); must differ "
        "from --token. Under mutual TLS an operator certificate also serves.")] = None,
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="Run without any authentication (logged as a warning).")] = False,
    state_dir: Annotated[Path | None, typer.Option(
        envvar="FEDGPU_STATE_DIR",
        help="Where the job database and each job's checkpoints live; without it they live "
        "in a temporary directory and are lost when the aggregator stops.")] = None,
    chunk_size: Annotated[int, typer.Option(
        help="Bytes per weight chunk on the wire.")] = DEFAULT_CHUNK_SIZE,
    max_update_mib: Annotated[int, typer.Option(
        help="Largest update accepted from a node, in MiB.")] = 4096,
    upload_idle_s: Annotated[float, typer.Option(
        min=1, envvar="FEDGPU_UPLOAD_IDLE_S",
        help="Refuse an update stream that sends nothing for this many seconds (every upload "
        "also ends at its round's deadline).")] = 60.0,
    upload_memory_mib: Annotated[int, typer.Option(
        min=1, envvar="FEDGPU_UPLOAD_MEMORY_MIB",
        help="Memory all update uploads in flight may hold together, in MiB (one larger "
        "update goes to the spool on disk, --upload-spool-mib).")] = 4096,
    upload_spool_mib: Annotated[int, typer.Option(
        min=0, envvar="FEDGPU_UPLOAD_SPOOL_MIB",
        help="Disk under STATE_DIR/spool that updates larger than --upload-memory-mib may "
        "hold together while they are received and folded, in MiB; one that would pass it "
        "is refused. 0: no spool, such an update is held in memory.")] = 16384,
    max_nodes: Annotated[int, typer.Option(
        min=1, envvar="FEDGPU_MAX_NODES",
        help="Most nodes registered at once; when full, the node lost the longest ago makes "
        "room.")] = 10_000,
    heartbeat_s: Annotated[int, typer.Option(help="Heartbeat interval given to nodes.")] = 5,
    exit_when_done: Annotated[bool, typer.Option(
        "--exit-when-done", help="Stop serving once every queued job has ended.")] = False,
    metrics_port: Annotated[int, typer.Option(
        envvar="FEDGPU_METRICS_PORT",
        help="Serve Prometheus metrics on http://METRICS_HOST:PORT/metrics; 0 = off.")] = 0,
    metrics_host: Annotated[str, typer.Option(
        envvar="FEDGPU_METRICS_HOST",
        help="Address the metrics port listens on; loopback unless you mean otherwise (it "
        "answers without a credential: the containers open it to their network only).")
    ] = "127.0.0.1",
    health_port: Annotated[int, typer.Option(
        envvar="FEDGPU_HEALTH_PORT", min=0, max=65535,
        help="Also answer grpc.health.v1 (and nothing else) in plaintext on this port, for "
        "probes without a client certificate such as Kubernetes' grpc: probes; 0 = off.")] = 0,
    ui_port: Annotated[int, typer.Option(
        envvar="FEDGPU_UI_PORT", min=0, max=65535,
        help="Serve the web dashboard on http://UI_HOST:PORT/ (needs --operator-token); "
        "0 = off.")] = 0,
    ui_host: Annotated[str, typer.Option(
        envvar="FEDGPU_UI_HOST",
        help="Address the dashboard listens on; loopback unless you mean otherwise (it is "
        "plain HTTP: reach it through an SSH tunnel).")] = "127.0.0.1",
    max_queued_jobs: Annotated[int, typer.Option(
        min=1, envvar="FEDGPU_MAX_QUEUED_JOBS",
        help="Most jobs waiting their turn; a submission past it is refused until some have "
        "run.")] = 100,
    max_concurrent_jobs: Annotated[int, typer.Option(
        min=1, max=64, envvar="FEDGPU_MAX_CONCURRENT_JOBS",
        help="Jobs that run at the same time, each on sites with a free slot (a site trains "
        "as many jobs at once as its node's --slots, 1 by default); a job whose sites are "
        "busy stays queued and says why. 1: one after the other.")] = 1,
    initial_weights_dir: Annotated[Path | None, typer.Option(
        envvar="FEDGPU_INITIAL_WEIGHTS_DIR",
        help="A directory of safetensors models a submitted job's initial_weights may name "
        "(by a path inside it); without it, initial weights come only with 'fedgpu job "
        "submit', which uploads the file.")] = None,
    tracking_uri: Annotated[str | None, typer.Option(
        envvar="FEDGPU_TRACKING_URI",
        help="Record each job as an MLflow run there: sqlite:///PATH (a local store), "
        "file:PATH, or a tracking server's http(s):// URI; needs fedgpu[tracking].")] = None,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "INFO",
) -> None:
    """Start the aggregator: the federation nodes join, and the jobs it runs one by one.

    Example: fedgpu server start --state-dir state --operator-token OPTOKEN --token TOKEN
    """
    from fedgpu.core import tls
    from fedgpu.server.app import ServerConfig, serve

    logs.setup(log_level)
    if job is not None:
        read_job_file(job)  # a bad job file fails here, with its key named, before anything runs
    cfg = ServerConfig(
        job_file=job,
        host=host,
        port=port,
        token=token,
        operator_token=operator_token,
        insecure=insecure,
        state_dir=state_dir,
        chunk_size=chunk_size,
        max_update_bytes=max_update_mib << 20,
        upload_idle_s=upload_idle_s,
        upload_memory_bytes=upload_memory_mib << 20,
        upload_spool_bytes=upload_spool_mib << 20,
        max_nodes=max_nodes,
        heartbeat_interval_s=heartbeat_s,
        exit_when_done=exit_when_done,
        tls=tls.from_options(tls_cert, tls_key, tls_ca),
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        health_port=health_port,
        ui_port=ui_port,
        ui_host=ui_host,
        bulk_port=bulk_port,
        max_queued_jobs=max_queued_jobs,
        max_concurrent_jobs=max_concurrent_jobs,
        initial_weights_dir=initial_weights_dir,
        tracking_uri=tracking_uri,
    )
    raise typer.Exit(asyncio.run(serve(cfg)))
