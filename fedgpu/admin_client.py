"""Ask a running aggregator: the Admin service and the standard health service."""

from __future__ import annotations

import json
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedgpu.errors import FedgpuError
from fedgpu.proto import admin_pb2, admin_pb2_grpc
from fedgpu.transport import channel, token_metadata

_REQUESTS = {
    "GetStatus": admin_pb2.GetStatusRequest,
    "ListNodes": admin_pb2.ListNodesRequest,
    "ListRounds": admin_pb2.ListRoundsRequest,
}


def _explain(address: str, exc: grpc.RpcError) -> FedgpuError:
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return FedgpuError(
            f"cannot reach aggregator at {address} — is it running? "
            f"try 'fedgpu status --address HOST:PORT' with the right address")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return FedgpuError(f"aggregator at {address}: {exc.details()}")
    return FedgpuError(f"aggregator at {address} answered {code.name}: {exc.details()}")


def query(address: str, token: str | None, method: str, timeout: float = 10) -> dict[str, Any]:
    with channel(address) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        try:
            reply = getattr(stub, method)(
                _REQUESTS[method](), metadata=token_metadata(token), timeout=timeout)
        except grpc.RpcError as exc:
            raise _explain(address, exc) from None
    return json.loads(reply.json)


def health(address: str, service: str = "", timeout: float = 5) -> str:
    """The health status name (SERVING, NOT_SERVING, ...) as a plain gRPC client sees it."""
    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            raise _explain(address, exc) from None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
