"""Registering with the aggregator: what the node says about itself, which refusals end the
agent (a wrong credential, a name another live node holds) and which are waited out (an
aggregator that is down), and a pause before registering again and again."""

from __future__ import annotations

import logging
import socket
import threading

import grpc

import fedgpu
from fedgpu.core import tls_diagnosis
from fedgpu.core.errors import FedgpuError
from fedgpu.node import data, messages, nvml, policy
from fedgpu.node.agent_config import AgentConfig
from fedgpu.node.client import AggregatorClient, is_unreachable
from fedgpu.node.retry import GaveUp, Repeats, RetryPolicy, Stopped, retry
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node")

# How the aggregator's refusal of a retired node begins (server/federation_service.py).
RETIRED_PREFIX = "retired: "


class Retired(Exception):
    """The operator retired this node (`fedgpu nodes forget`, `server stop --retire-nodes`):
    the agent's service is over, and it exits cleanly."""


# Refusals that another try cannot change: the agent stops and says why.
FINAL = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS)


def request(cfg: AgentConfig, identity: str, snapshot: nvml.NvmlSnapshot,
            decision: policy.Decision, capacity: pb.NodeCapacity | None,
            task_approval: str) -> pb.RegisterRequest:
    from fedgpu.node.tasks import available_tasks

    assert cfg.name is not None
    return pb.RegisterRequest(
        node_name=cfg.name,
        identity=identity,
        version=fedgpu.__version__,
        devices=messages.inventory(snapshot),
        decision=messages.decision(decision),
        labels={"hostname": socket.gethostname()},
        tasks=available_tasks(),
        ring_host=cfg.ring_host,
        ring_port=cfg.ring_port,
        num_examples=data.train_examples(cfg.data_dir),
        capacity=capacity,
        task_approval=task_approval,
        site_policy_json=cfg.site_policy.to_json() if cfg.site_policy is not None else "",
        slots=cfg.slots,
    )


def _once(client: AggregatorClient, cfg: AgentConfig, req: pb.RegisterRequest
          ) -> pb.RegisterReply:
    """One Register call; errors that another try cannot fix become a FedgpuError."""
    try:
        return client.register(req)
    except grpc.RpcError as exc:
        details = exc.details() or ""
        if (exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                and details.startswith(RETIRED_PREFIX)):
            raise Retired(details.removeprefix(RETIRED_PREFIX)) from None
        if exc.code() in FINAL:
            raise FedgpuError(f"aggregator at {cfg.aggregator} refused us: "
                              f"{exc.details()}") from None
        # A refused certificate, a wrong name or a wrong port read as UNAVAILABLE, like an
        # outage; retrying would only hide the cause, so look, and stop if it is one of those.
        why = (tls_diagnosis.diagnose(cfg.aggregator, cfg.tls)
               if tls_diagnosis.worth_probing(exc) else None)
        if why is not None:
            raise FedgpuError(str(why)) from None
        if not is_unreachable(exc):
            raise FedgpuError(f"registration failed: {exc.details()}") from None
        raise


def register(client: AggregatorClient, cfg: AgentConfig, req: pb.RegisterRequest,
             repeats: Repeats, policy_: RetryPolicy, stop: threading.Event
             ) -> pb.RegisterReply:
    """Register, retrying an unreachable aggregator until the policy's deadline (FedgpuError
    then); Stopped when `stop` is set meanwhile, Retired when the operator retired us."""
    pause = repeats.next_delay()
    if pause:
        log.warning("the aggregator forgot this node again soon after it registered (%d "
                    "times in a row); registering again in %.0fs", repeats.streak, pause)
        if stop.wait(pause):
            raise Stopped("register")

    def waiting(exc: BaseException, delay: float) -> None:
        log.info("aggregator %s unreachable; retrying in %.1fs", cfg.aggregator, delay)

    try:
        return retry(lambda: _once(client, cfg, req), what="register", policy=policy_,
                     retryable=is_unreachable, stop=stop, on_retry=waiting)
    except GaveUp:
        raise FedgpuError(
            f"cannot reach aggregator at {cfg.aggregator} — is it running and "
            "is the address right? try 'fedgpu status --address "
            f"{cfg.aggregator}'") from None
