"""Build and run the aggregator: Federation + Admin + health + reflection on one port, the
job queue behind them, and the optional metrics and dashboard endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fedgpu.core import codec
from fedgpu.core.audit import AUDIT_FILE, AuditLog
from fedgpu.core.constants import JobState
from fedgpu.core.errors import ConfigError, FedgpuError
from fedgpu.core.tls import TlsFiles, server_credentials, ssl_server_context
from fedgpu.core.transport import SERVER_OPTIONS, check_chunk_size, is_loopback
from fedgpu.proto import admin_pb2, admin_pb2_grpc, pb, pb_grpc
from fedgpu.server.admin_service import AdminService
from fedgpu.server.auth import Auth
from fedgpu.server.federation_service import FederationService
from fedgpu.server.jobs.events import JobLogHandler
from fedgpu.server.jobs.intake import DEFAULT_MAX_QUEUED
from fedgpu.server.jobs.queue import JobManager
from fedgpu.server.jobs.store import JobStore
from fedgpu.server.lifecycle import Lifecycle
from fedgpu.server.people import People
from fedgpu.server.permissions import job_study
from fedgpu.server.registry import DEFAULT_MAX_NODES, Registry
from fedgpu.server.registry_store import RegistryStore
from fedgpu.server.studies import Studies
from fedgpu.server.transfer.bulk_server import BulkServer
from fedgpu.server.transfer.spool import DEFAULT_SPOOL_BYTES, SPOOL_DIR, Spool
from fedgpu.server.transfer.tickets import TicketBook
from fedgpu.server.transfer.uploads import DEFAULT_BUDGET_BYTES, DEFAULT_IDLE_S, Uploads
from fedgpu.server.views import documents as docs

if TYPE_CHECKING:
    from fedgpu.server.views.dashboard import DashboardServer

log = logging.getLogger("fedgpu.server")

DEFAULT_MAX_UPDATE_BYTES = 4 << 30


@dataclass
class ServerConfig:
    # A job file queued at start (once per state directory); None: wait for submitted jobs.
    job_file: Path | None = None
    # Loopback unless told otherwise: containers pass --host 0.0.0.0 explicitly.
    host: str = "127.0.0.1"
    port: int = 50051
    token: str | None = None
    operator_token: str | None = None
    insecure: bool = False
    state_dir: Path | None = None
    chunk_size: int = codec.DEFAULT_CHUNK_SIZE
    max_update_bytes: int = DEFAULT_MAX_UPDATE_BYTES
    # An upload that sends nothing for this long is refused; all uploads in flight share
    # this much memory (see server/transfer/uploads.py).
    upload_idle_s: float = DEFAULT_IDLE_S
    upload_memory_bytes: int = DEFAULT_BUDGET_BYTES
    # Disk under STATE_DIR/spool that updates larger than the memory budget may hold together
    # (server/transfer/spool.py); 0: no spool, such an update is held in memory.
    upload_spool_bytes: int = DEFAULT_SPOOL_BYTES
    # Nodes the registry holds; when full, the node lost the longest ago makes room.
    max_nodes: int = DEFAULT_MAX_NODES
    heartbeat_interval_s: int = 5
    # Stop serving once every queued job has ended (`fedgpu run`).
    exit_when_done: bool = False
    # cert+key: serve TLS; plus ca: require client certificates it signed (mutual TLS).
    tls: TlsFiles | None = None
    # Prometheus text format on metrics_host:metrics_port; 0 = off. Loopback unless told
    # otherwise: it answers anyone who reaches it, with no credential.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # grpc.health.v1 alone, in plaintext, on this port (same --host); 0 = off. For probes
    # that cannot present a client certificate (Kubernetes' native `grpc:` probes): it
    # answers SERVING or NOT_SERVING and nothing else.
    health_port: int = 0
    # The web dashboard (server/views/dashboard.py) on ui_host:ui_port; 0 = off. Loopback unless
    # asked: it is plain HTTP, reached from elsewhere through an SSH tunnel.
    ui_port: int = 0
    ui_host: str = "127.0.0.1"
    # The bulk data path (server/transfer/bulk_server.py) on host:bulk_port, TLS as the gRPC port;
    # 0 = off: weights move over gRPC only. None: the gRPC port + 1, best effort (a port that
    # is taken is said once in the log and the aggregator serves weights over gRPC; a port
    # asked for by number that cannot be had is an error).
    bulk_port: int | None = None
    # Jobs waiting their turn (server/jobs/intake.py); a submission past it is refused.
    max_queued_jobs: int = DEFAULT_MAX_QUEUED
    # Jobs that run at the same time, on sites no other running job holds (server/jobs/
    # scheduling.py); 1: one after the other.
    max_concurrent_jobs: int = 1
    # Where a submitted job's `initial_weights` may name a file; None: only uploaded weights.
    initial_weights_dir: Path | None = None
    # Each job as one MLflow run at this tracking URI (server/tracking/); None: off.
    tracking_uri: str | None = None


def _check(cfg: ServerConfig) -> bool:
    """Refuse configurations that would leave the federation open; True under mutual TLS."""
    mutual = cfg.tls is not None and cfg.tls.ca is not None
    if not cfg.insecure and not cfg.token and not mutual:
        raise ConfigError(
            "the aggregator needs --token (or FEDGPU_TOKEN) and/or mutual TLS (--tls-cert, "
            "--tls-key, --tls-ca) so only your nodes can join; pass --insecure to run without "
            "any authentication"
        )
    if cfg.operator_token and cfg.operator_token == cfg.token:
        raise ConfigError("--operator-token must differ from --token: nodes hold the token, "
                          "and a node must not be able to submit or stop jobs")
    if cfg.ui_port and not cfg.operator_token:
        raise ConfigError("--ui-port needs --operator-token (FEDGPU_OPERATOR_TOKEN): the "
                          "dashboard never serves its data without the operator credential")
    if cfg.insecure:
        log.warning("INSECURE MODE: no token%s — anyone who reaches port %d can join "
                    "this federation, read its model and submit jobs",
                    "" if cfg.tls else ", no TLS", cfg.port)
    elif cfg.tls is None and not is_loopback(cfg.host):
        log.warning("serving plaintext on %s (not loopback): the token and the model cross "
                    "the network in clear text; use --tls-cert/--tls-key/--tls-ca outside a "
                    "trusted network", cfg.host)
    if not cfg.insecure and not cfg.operator_token and not mutual:
        log.warning("no --operator-token: nobody can submit jobs or ask for the status; "
                    "set FEDGPU_OPERATOR_TOKEN (or use mutual TLS with an operator "
                    "certificate from 'fedgpu certs operator')")
    return mutual


async def serve(cfg: ServerConfig, ready: asyncio.Event | None = None) -> int:
    mutual = _check(cfg)
    credentials = server_credentials(cfg.tls) if cfg.tls is not None else None
    check_chunk_size(cfg.chunk_size)
    with contextlib.ExitStack() as stack:
        state_dir = cfg.state_dir
        if state_dir is None:
            state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="fedgpu-state-")))
            log.warning("no --state-dir: jobs, their history and models live in %s and are "
                        "lost when the aggregator stops", state_dir)
        store = JobStore(state_dir)
        stack.callback(store.close)
        nodes = RegistryStore(state_dir)
        stack.callback(nodes.close)
        registry = Registry(cfg.heartbeat_interval_s, max_nodes=cfg.max_nodes, store=nodes)
        return await _serve(cfg, mutual, credentials, store, registry, state_dir, ready)


async def _serve(cfg: ServerConfig, mutual: bool, credentials: grpc.ServerCredentials | None,
                 store: JobStore, registry: Registry, state_dir: Path,
                 ready: asyncio.Event | None) -> int:
    lifecycle = Lifecycle()
    studies = Studies(state_dir)
    jobs = JobManager(store, registry, state_dir, cfg.chunk_size, cfg.max_queued_jobs,
                      cfg.initial_weights_dir, cfg.max_update_bytes, studies=studies,
                      max_concurrent=cfg.max_concurrent_jobs)
    uploads = jobs.uploads = Uploads(cfg.max_update_bytes, cfg.upload_memory_bytes,
                                     cfg.upload_idle_s)
    # A parked upload whose round closed (or whose job stopped) is let go at once.
    uploads.wanted = lambda node_id, task_id: (
        (node := registry.get(node_id)) is not None and jobs.wants(node, task_id))
    if cfg.upload_spool_bytes > 0:
        uploads.spool = Spool(state_dir / SPOOL_DIR, cfg.upload_spool_bytes,
                              cfg.upload_memory_bytes)
    events = JobLogHandler(jobs)
    logging.getLogger("fedgpu.server").addHandler(events)
    jobs.intake.adopt_legacy(cfg.job_file)
    if cfg.job_file is not None:
        jobs.intake.submit_at_start(cfg.job_file)
    federation_id = secrets.token_hex(6)
    people = People(state_dir)
    audit_log = AuditLog(state_dir / AUDIT_FILE)
    auth = Auth(None if cfg.insecure else cfg.token,
                None if cfg.insecure else cfg.operator_token,
                client_certs=mutual, insecure=cfg.insecure, people=people,
                audit_log=audit_log)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    tickets = TicketBook() if cfg.bulk_port != 0 else None
    federation = FederationService(registry, jobs, auth, uploads, federation_id, tickets,
                                   lifecycle=lifecycle)
    pb_grpc.add_FederationServicer_to_server(federation, server)
    dashboard = {"host": cfg.ui_host, "port": cfg.ui_port} if cfg.ui_port else None
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(jobs, auth, lifecycle, dashboard),
                                               server)
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
    closers: list[Any] = []
    # By default beside the port gRPC got (which --port 0 leaves to the system to pick).
    wanted_bulk = cfg.bulk_port if cfg.bulk_port is not None else bound + 1
    if tickets is not None and wanted_bulk <= 65535:
        bulk = BulkServer(federation, federation.uploads, tickets, cfg.host, wanted_bulk,
                          ssl_server_context(cfg.tls) if cfg.tls is not None else None, mutual,
                          downloads=jobs.downloads)
        try:
            federation.bulk_port = await bulk.start()
        except OSError as exc:
            if cfg.bulk_port is not None:
                raise FedgpuError(str(exc)) from None
            log.warning("no bulk data path: %s (the default, the gRPC port + 1); weights move "
                        "over gRPC only. Pass --bulk-port PORT for another, 0 for none", exc)
        else:
            closers.append(bulk)
            uploads.bulk = bulk.stats
    probe_server = None
    if cfg.health_port:
        probe_server = grpc.aio.server(options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probe_server)
        probe_address = f"{cfg.host}:{cfg.health_port}"
        try:
            probe_bound = probe_server.add_insecure_port(probe_address)
        except RuntimeError:
            probe_bound = 0
        if probe_bound == 0:
            raise FedgpuError(f"cannot serve the health probe on {probe_address}: is the port "
                              "in use? pick another --health-port (0 turns it off)")
    if cfg.metrics_port:
        from fedgpu.server.views.metrics import serve_metrics

        closers.append(await serve_metrics(jobs, cfg.metrics_host, cfg.metrics_port))
    if cfg.ui_port:
        closers.append(await _serve_dashboard(cfg, jobs, auth))
    if cfg.tracking_uri:
        from fedgpu.server.tracking.follower import TrackingFollower

        follower = TrackingFollower(jobs, cfg.tracking_uri)
        await follower.start()
        closers.append(follower)
    await server.start()
    if probe_server is not None:
        await probe_server.start()
    for name in ("", *names[:2]):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("aggregator %s listening on %s (%s); %s; %d job(s) queued", federation_id,
             address, "mutual TLS" if mutual else "TLS" if cfg.tls else "plaintext",
             f"bulk data path on port {federation.bulk_port}" if federation.bulk_port
             else "no bulk port (weights over gRPC only)", len(store.pending()))
    if ready is not None:
        ready.set()

    stop = lifecycle.stop
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
    run_task = asyncio.create_task(jobs.run_forever())
    flusher = asyncio.create_task(_flush_registry(registry, cfg.heartbeat_interval_s))
    stop_wait = asyncio.create_task(stop.wait())
    waits = {stop_wait}
    if cfg.exit_when_done:
        waits.add(asyncio.create_task(_queue_done(jobs)))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if not stop.is_set():
        # `fedgpu run`: the run is over, and so is the federation it made.
        lifecycle.retire = "the run is over"
    jobs.exiting.set()
    if stop.is_set():
        log.info("shutting down on %s: %s",
                 "request ('fedgpu server stop')" if lifecycle.requested else "signal",
                 "retiring every node" if lifecycle.retire
                 else "nodes keep their registration and reconnect after a restart")
    for node in registry.all():
        # Polls end now: retired nodes hear so, the others that the aggregator is stopping.
        node.wakeup.set()
    if lifecycle.retire:
        # Give polling nodes a moment to hear it before the port closes.
        await _drain(registry, timeout=8.0)
        registry.retire_all()
    flusher.cancel()
    if not lifecycle.retire:
        registry.flush()
    run_task.cancel()
    for t in waits:
        t.cancel()
    # Checkpoints are written between rounds, so by the time the signal handler ran none
    # was half-written; waiting for the cancelled job only lets it record where it was.
    await asyncio.gather(run_task, flusher, *waits, return_exceptions=True)
    logging.getLogger("fedgpu.server").removeHandler(events)
    for closer in closers:
        await closer.close()
    await health_servicer.enter_graceful_shutdown()
    if probe_server is not None:
        await probe_server.stop(grace=1)
    await server.stop(grace=3)
    uploads.close()
    people.close()
    studies.close()
    if stop.is_set():
        log.info("stopped cleanly; restart with the same --state-dir to resume the queue")
        return 0
    last = store.jobs(limit=1)
    return 0 if last and last[0].state == JobState.FINISHED else 1


async def _flush_registry(registry: Registry, interval_s: float) -> None:
    """Nodes' last-seen times to disk every few heartbeats (at least 10 s apart: one
    transaction for the whole registry each time); a SIGKILL loses that much."""
    while True:
        await asyncio.sleep(max(10.0, 2 * interval_s))
        try:
            registry.flush()
        except sqlite3.Error as exc:
            log.warning("cannot save the node registry: %s", exc)


async def _queue_done(jobs: JobManager) -> None:
    """Until every job queued so far has ended (at least one must have run)."""
    while True:
        await jobs.idle.wait()
        if jobs.store.jobs(limit=1):
            return
        await asyncio.sleep(0.5)


async def _serve_dashboard(cfg: ServerConfig, jobs: JobManager, auth: Auth) -> DashboardServer:
    from fedgpu.server.views.dashboard import DashboardServer, DashboardSources
    from fedgpu.server.views.dashboard_auth import token_check

    assert cfg.operator_token
    if not is_loopback(cfg.ui_host):
        log.warning("the dashboard listens on %s over plain HTTP: whoever reaches it there "
                    "can try the operator token, which crosses that network in clear text; "
                    "publish it on localhost only (as compose does) or keep --ui-host "
                    "127.0.0.1 and use an SSH tunnel", cfg.ui_host)
    dashboard = DashboardServer(DashboardSources(
        # The same document as GetStatus (fedgpu status --json).
        status=lambda: {**docs.status_of(jobs),
                        "dashboard": {"host": cfg.ui_host, "port": cfg.ui_port}},
        nodes=lambda: docs.nodes_doc(jobs.registry),
        rounds=lambda: docs.rounds_of(jobs),
        is_operator=token_check(cfg.operator_token),
        jobs=lambda: docs.jobs_doc(jobs),
        person=auth.person_of_token,
        audit=auth.audit_soon,
        job_study=lambda job_id: job_study(jobs.store.get(job_id)),
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
