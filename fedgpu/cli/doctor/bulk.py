"""`fedgpu doctor`'s bulk-port check: can this host reach the aggregator's bulk data port
(and finish its TLS handshake) as well as its gRPC port? A node that cannot falls back to
gRPC by itself; the check says so before a big model makes it matter."""

from __future__ import annotations

from typing import Any

from fedgpu.cli.doctor.result import OK, WARN, Check
from fedgpu.core.errors import FedgpuError

NAME = "bulk_port"


def advertised_port(address: str, token: str | None, tls: Any,
                    operator_token: str | None) -> int | str:
    """The aggregator's bulk port (0: none), or why it could not be asked: from the status
    with the operator's credential, else from a heartbeat for no node (a node's)."""
    import grpc

    from fedgpu.core import admin_client
    from fedgpu.core.transport import channel, token_metadata
    from fedgpu.proto import pb, pb_grpc

    if operator_token is not None:
        try:
            st = admin_client.query(address, operator_token, "GetStatus", tls=tls, timeout=5)
        except FedgpuError as exc:
            return str(exc)
        return int((st.get("bulk") or {}).get("port") or 0)
    with channel(address, tls) as ch:
        try:
            reply = pb_grpc.FederationStub(ch).Heartbeat(
                pb.HeartbeatRequest(node_id=""), metadata=token_metadata(token), timeout=5)
        except grpc.RpcError as exc:
            return exc.details() or exc.code().name
    return int(reply.bulk_port)


def bulk_check(address: str, token: str | None, tls: Any,
               operator_token: str | None = None) -> Check:
    from fedgpu.core import bulk

    port = advertised_port(address, token, tls, operator_token)
    if isinstance(port, str):
        return Check(NAME, WARN, f"could not ask the aggregator for its bulk port: {port}",
                     "check the credentials given to doctor (--token, --tls-*)")
    if port == 0:
        return Check(NAME, OK, "the aggregator has no bulk port: weights move over gRPC "
                     "(start it with --bulk-port for big models)")
    host = bulk.host_of(address)
    try:
        sock = bulk.connect(host, port, tls, timeout=5)
    except bulk.BulkUnreachable as exc:
        return Check(NAME, WARN, f"{exc}: nodes on this host will move weights over gRPC "
                     "(several times slower for big models)",
                     f"open TCP port {port} from this site to {host} (the firewall rule the "
                     "gRPC port has), or publish it (compose: FEDGPU_BULK_PUBLISH_PORT)")
    sock.close()  # a quiet probe: the aggregator does not count it as a refusal
    how = "TLS handshake done" if tls is not None else "plain TCP"
    return Check(NAME, OK, f"bulk port {host}:{port} reachable ({how})")

