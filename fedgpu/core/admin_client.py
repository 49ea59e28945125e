"""Ask a running aggregator: the Admin service and the standard health service."""

from __future__ import annotations

import json
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedgpu.core import tls as tlsmod
from fedgpu.core.errors import FedgpuError
from fedgpu.core.jsondoc import COUNT_KEY
from fedgpu.core.tls import TlsFiles
from fedgpu.core.transport import channel, token_metadata
from fedgpu.proto import admin_pb2, admin_pb2_grpc

_REQUESTS = {
    "GetStatus": admin_pb2.GetStatusRequest,
    "ListNodes": admin_pb2.ListNodesRequest,
    "ListRounds": admin_pb2.ListRoundsRequest,
}


def _explain(address: str, exc: grpc.RpcError, tls: TlsFiles | None = None) -> FedgpuError:
    code = exc.code()
    if tlsmod.looks_like_tls_failure(exc):
        why = tlsmod.diagnose(address, tls)
        if why is not None:
            return FedgpuError(why)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return FedgpuError(
            f"cannot reach aggregator at {address} — is it running? "
            f"try 'fedgpu status --address HOST:PORT' with the right address")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return FedgpuError(f"aggregator at {address}: {exc.details()}")
    return FedgpuError(f"aggregator at {address} answered {code.name}: {exc.details()}")


# The list documents come in pages (each fits a gRPC message); query() joins them.
_PAGED = {"ListNodes": "nodes", "ListRounds": "rounds"}


def query(address: str, token: str | None, method: str, timeout: float = 10,
          tls: TlsFiles | None = None) -> dict[str, Any]:
    """The method's whole document (every page of a list)."""
    with channel(address, tls) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)

        def ask(**fields: int) -> dict[str, Any]:
            try:
                reply = getattr(stub, method)(
                    _REQUESTS[method](**fields), metadata=token_metadata(token),
                    timeout=timeout)
            except grpc.RpcError as exc:
                raise _explain(address, exc, tls) from None
            doc: dict[str, Any] = json.loads(reply.json)
            return doc

        doc = ask()
        key = _PAGED.get(method)
        while key is not None and doc.get("next_offset") is not None:
            more = ask(offset=int(doc.pop("next_offset")))
            doc[key].extend(more[key])
            doc["next_offset"] = more.get("next_offset")
            if more.get(COUNT_KEY):
                doc[COUNT_KEY] = doc.get(COUNT_KEY, 0) + more[COUNT_KEY]
        doc.pop("next_offset", None)
    return doc


def health(address: str, service: str = "", timeout: float = 5,
           tls: TlsFiles | None = None) -> str:
    """The health status name (SERVING, NOT_SERVING, ...) as a plain gRPC client sees it."""
    with channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            raise _explain(address, exc, tls) from None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
