"""Build and run the aggregator: Federation + Admin + health + reflection on one port."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fedgpu.core import codec
from fedgpu.core.config import Job
from fedgpu.core.constants import Mode, RunState
from fedgpu.core.errors import ConfigError, FedgpuError
from fedgpu.core.tls import TlsFiles, server_credentials
from fedgpu.core.transport import SERVER_OPTIONS, check_chunk_size
from fedgpu.proto import admin_pb2, admin_pb2_grpc, pb, pb_grpc
from fedgpu.server import resume
from fedgpu.server.admin_service import AdminService, nodes_doc, rounds_doc, status_doc
from fedgpu.server.auth import TokenAuth
from fedgpu.server.checkpoint import Checkpointer
from fedgpu.server.federation_service import FederationService
from fedgpu.server.registry import Registry
from fedgpu.server.ring import RingPlan
from fedgpu.server.rounds import Orchestrator

if TYPE_CHECKING:
    from fedgpu.server.dashboard import DashboardServer

log = logging.getLogger("fedgpu.server")

DEFAULT_MAX_UPDATE_BYTES = 4 << 30


@dataclass
class ServerConfig:
    job: Job
    host: str = "0.0.0.0"
    port: int = 50051
    token: str | None = None
    insecure: bool = False
    state_dir: Path | None = None
    chunk_size: int = codec.DEFAULT_CHUNK_SIZE
    max_update_bytes: int = DEFAULT_MAX_UPDATE_BYTES
    heartbeat_interval_s: int = 5
    exit_when_done: bool = False
    # cert+key: serve TLS; plus ca: require client certificates it signed (mutual TLS).
    tls: TlsFiles | None = None
    # Prometheus text format on this port (same --host); 0 = off.
    metrics_port: int = 0
    # The web dashboard (server/dashboard.py) on ui_host:ui_port; 0 = off. Loopback unless
    # asked: it is plain HTTP, reached from elsewhere through an SSH tunnel.
    ui_port: int = 0
    ui_host: str = "127.0.0.1"


def _initial_weights(job: Job) -> dict | None:
    if job.initial_weights is None:
        return None
    path = Path(job.initial_weights)
    try:
        tensors, _ = codec.decode(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"initial_weights {path} does not exist") from None
    except codec.CodecError as exc:
        raise ConfigError(f"initial_weights {path} is not a safetensors file: {exc}") from None
    return dict(tensors)


async def serve(cfg: ServerConfig, ready: asyncio.Event | None = None) -> int:
    mutual = cfg.tls is not None and cfg.tls.ca is not None
    if not cfg.insecure and not cfg.token and not mutual:
        raise ConfigError(
            "the aggregator needs --token (or FEDGPU_TOKEN) and/or mutual TLS (--tls-cert, "
            "--tls-key, --tls-ca) so only your nodes can join; pass --insecure to run without "
            "any authentication"
        )
    if cfg.ui_port and not cfg.token:
        # TEMPORARY: --token is the operator credential until jobs add --operator-token.
        raise ConfigError("--ui-port needs the operator token, which is --token (FEDGPU_TOKEN) "
                          "for now: the dashboard never serves its data without a credential")
    if cfg.insecure:
        log.warning("INSECURE MODE: no token%s — anyone who reaches port %d can join "
                    "this federation and read its model",
                    "" if cfg.tls else ", no TLS", cfg.port)
    elif cfg.tls is None:
        log.warning("no TLS: the token and the model cross the network in plaintext; use "
                    "--tls-cert/--tls-key/--tls-ca outside a trusted network")
    credentials = server_credentials(cfg.tls) if cfg.tls is not None else None
    check_chunk_size(cfg.chunk_size)
    registry = Registry(cfg.heartbeat_interval_s)
    initial = _initial_weights(cfg.job)
    checkpointer = Checkpointer(cfg.state_dir) if cfg.state_dir else None
    saved = checkpointer.load() if checkpointer is not None else None
    if saved is not None:
        assert cfg.state_dir is not None
        resume.check(cfg.job, saved[0], saved[1], initial, cfg.state_dir)
    # Ring mode (D-PSGD) coordinates instead of aggregating; see server/ring.py.
    orch = Orchestrator(
        cfg.job,
        registry,
        chunk_size=cfg.chunk_size,
        checkpointer=checkpointer,
        initial_weights=initial,
        plan=RingPlan(cfg.job) if cfg.job.mode == Mode.RING else None,
    )
    if saved is not None:
        orch.restore(*saved)
    auth = TokenAuth(None if cfg.insecure else cfg.token, client_certs=mutual)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_FederationServicer_to_server(
        FederationService(registry, orch, auth, cfg.max_update_bytes), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(orch, registry, auth), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb.DESCRIPTOR.services_by_name["Federation"].full_name,
        admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    address = f"{cfg.host}:{cfg.port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError as exc:
        raise FedgpuError(f"cannot listen on {address}: {exc}; is the port in use?") from None
    if bound == 0:
        raise FedgpuError(f"cannot listen on {address}: is the port already in use?")
    if cfg.metrics_port:
        from fedgpu.server.metrics import serve_metrics

        metrics = await serve_metrics(orch, registry, cfg.host, cfg.metrics_port)
    if cfg.ui_port:
        dashboard = await _serve_dashboard(cfg, orch, registry)
    await server.start()
    for name in ("", *names[:2]):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("aggregator %s listening on %s (%s); job: task=%s rounds=%d min_nodes=%d",
             orch.run_id, address,
             "mutual TLS" if mutual else "TLS" if cfg.tls else "plaintext",
             cfg.job.task, cfg.job.rounds, cfg.job.min_nodes)
    if ready is not None:
        ready.set()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Installed explicitly, so SIGINT works even when inherited as ignored (a script's `&`);
    # SIGHUP stops us too, unless it is ignored (`nohup`).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    run_task = asyncio.create_task(orch.run())
    stop_wait = asyncio.create_task(stop.wait())
    done_wait = asyncio.create_task(orch.finished.wait())
    while True:
        await asyncio.wait({stop_wait, done_wait}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            log.info("shutting down on signal")
            break
        if done_wait.done() and cfg.exit_when_done:
            # Give polling nodes a moment to hear "shutdown" before the port closes.
            await _drain(registry, timeout=8.0)
            break
        if done_wait.done():
            done_wait = asyncio.create_task(asyncio.Event().wait())
    run_task.cancel()
    for t in (stop_wait, done_wait):
        t.cancel()
    # Checkpoints are written synchronously between rounds, so by the time the signal handler
    # ran none was half-written; waiting for the cancelled run only lets it record "stopped".
    await asyncio.gather(run_task, return_exceptions=True)
    if cfg.metrics_port:
        await metrics.close()
    if cfg.ui_port:
        await dashboard.close()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=3)
    if stop.is_set():
        log.info("stopped cleanly after round %d; restart with the same --state-dir to resume",
                 orch.global_round)
        return 0
    return 0 if orch.state == RunState.FINISHED else 1


async def _serve_dashboard(cfg: ServerConfig, orch: Orchestrator, registry: Registry
                           ) -> DashboardServer:
    from fedgpu.server.dashboard import DashboardServer, DashboardSources
    from fedgpu.server.dashboard_auth import token_check

    # TEMPORARY until jobs land: the aggregator's --token stands in for the operator
    # credential (checked in serve()). The jobs work swaps in --operator-token
    # (FEDGPU_OPERATOR_TOKEN) here, and `jobs=` gets the producer of `fedgpu job list --json`.
    assert cfg.token
    if cfg.ui_host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("the dashboard listens on %s over plain HTTP: whoever reaches it there "
                    "can try the operator token, which crosses that network in clear text; "
                    "publish it on localhost only (as compose does) or keep --ui-host "
                    "127.0.0.1 and use an SSH tunnel", cfg.ui_host)
    dashboard = DashboardServer(DashboardSources(
        status=lambda: status_doc(orch, registry),
        nodes=lambda: nodes_doc(registry),
        rounds=lambda: rounds_doc(orch),
        is_operator=token_check(cfg.token),
        jobs=None,
    ))
    await dashboard.start(cfg.ui_host, cfg.ui_port)
    return dashboard


async def _drain(registry: Registry, timeout: float, minimum: float = 3.0) -> None:
    # At least `minimum` seconds, so that whoever polls the Admin service (`fedgpu run`, a
    # watching operator) sees the final state before the port closes, however fast the end.
    loop = asyncio.get_running_loop()
    start = loop.time()
    while loop.time() < start + timeout and (
        loop.time() < start + minimum
        or any(n.state != "shutdown" for n in registry.alive())
    ):
        await asyncio.sleep(0.25)
