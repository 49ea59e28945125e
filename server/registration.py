"""What a node says about itself when it registers and in each heartbeat (its GPUs, capacity,
site policy, links), checked and written to the registry. The Federation service
(server/federation_service.py) calls these and answers; the transfers stay there."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from fedgpu.core import site_policy, slots
from fedgpu.core.admission import SiteCapacity
from fedgpu.core.admission_wire import capacity_from_wire
from fedgpu.core.errors import ConfigError
from fedgpu.core.site_policy import SitePolicy
from fedgpu.proto import pb
from fedgpu.server.auth import Auth
from fedgpu.server.registry import NameTaken, Node, Registry, RegistryFull, Retired
from fedgpu.server.transfer import wire_limits
from fedgpu.server.transfer.wire_limits import WireError

# The service's logger: these lines were always the Federation service's own.
log = logging.getLogger("fedgpu.server.federation")


async def register(registry: Registry, auth: Auth, request: pb.RegisterRequest,
                   context: grpc.aio.ServicerContext) -> Node:
    """The node a registration adds (or renews); the call is aborted with the reason when the
    request is malformed, the name is another site's, the registry is full or the site
    retired."""
    try:
        name = wire_limits.check_registration(request)
    except WireError as exc:
        log.warning("refused registration from %s: %s", context.peer(), exc)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"registration refused: {exc}")
    # A node without some job's task still joins: it is left out of that job, and
    # `fedgpu job status` says why.
    await auth.bind(context, name, "registration")
    capacity = await _capacity(request, context)
    try:
        node = registry.register(
            name=name,
            peer=context.peer(),
            version=request.version,
            devices=_as_dict(request.devices),
            decision=_as_dict(request.decision),
            labels=dict(request.labels),
            tasks=list(request.tasks),
            identity=request.identity,
        )
    except RegistryFull as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    except NameTaken as exc:
        log.warning("refused registration from %s: %s", context.peer(), exc)
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
    except Retired as exc:
        log.info("refused registration from %s: %s", context.peer(), exc)
        # The agent reads "retired:" as the end of its service, not as an error.
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"retired: {exc}")
    node.ring_host, node.ring_port = request.ring_host.strip(), request.ring_port
    node.stated_examples = max(request.num_examples, 0)
    node.capacity = capacity
    node.task_approval = request.task_approval
    node.slots = slots.advertised(request.slots)
    node.site_policy = _site_policy(request, name)
    node.policy_refusal = None  # it may have restarted with another policy
    log.info("node %s registered as %s from %s; gpu decision: %s", name, node.node_id,
             node.peer, request.decision.reason or "n/a")
    auth.audit_soon(f"node {name}", "node.register", node.node_id, "OK", node.peer)
    return node


async def heartbeat(registry: Registry, node: Node, request: pb.HeartbeatRequest,
                    context: grpc.aio.ServicerContext) -> None:
    """Take what a known node's heartbeat reports (its state, link rates, GPU decision and
    capacity); a malformed heartbeat is aborted with the reason."""
    try:
        wire_limits.check_heartbeat(request)
    except WireError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"heartbeat refused: {exc}")
    registry.touch(node.node_id)
    node.state = request.state or node.state
    registry.link(node.name).report(request.down_bytes_per_s, request.up_bytes_per_s)
    if request.HasField("decision"):
        node.decision = _as_dict(request.decision)
    capacity = await _capacity(request, context)
    if capacity is not None:
        registry.report_capacity(node, capacity)


def _as_dict(msg: Any) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


async def _capacity(request: pb.RegisterRequest | pb.HeartbeatRequest,
                    context: grpc.aio.ServicerContext) -> SiteCapacity | None:
    """The node's reported GPU capacity (None when it reports none); a malformed one is
    refused with the reason."""
    if not request.HasField("capacity"):
        return None
    try:
        return capacity_from_wire(request.capacity)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"capacity refused: {exc}")
        raise  # abort raises; this line only tells the type checker


def _site_policy(request: pb.RegisterRequest, name: str) -> SitePolicy | None:
    """The policy the node advertised (None: none, or one this aggregator cannot read: the
    node decides for itself either way, so the registration stands)."""
    try:
        return site_policy.from_json(request.site_policy_json, f"node {name}'s site policy")
    except ConfigError as exc:
        log.warning("%s: its tasks are offered as if it had none (it checks them itself)", exc)
        return None
