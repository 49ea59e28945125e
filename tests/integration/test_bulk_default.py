"""The bulk data path is on by default (`fedgpu server start` with no --bulk-port: the gRPC
port + 1), a taken default port leaves the aggregator serving over gRPC with one warning, and
a port asked for by number that cannot be had stops it with the reason."""

from __future__ import annotations

import socket

import pytest

from fedgpu.core import admin_client
from fedgpu.proto import pb, pb_grpc
from tests.fixtures.federation import Federation, free_port


def _bulk_port(federation: Federation) -> int:
    import grpc

    with grpc.insecure_channel(federation.address) as ch:
        # A heartbeat for no node tells anyone with a node credential the bulk port.
        reply = pb_grpc.FederationStub(ch).Heartbeat(
            pb.HeartbeatRequest(node_id=""), metadata=(("x-fedgpu-token", federation.token),),
            timeout=10)
    return reply.bulk_port


def _free_pair() -> int:
    """A port p with p + 1 free as well (best effort)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    pytest.skip("no two adjacent free ports on loopback")


def test_the_bulk_port_is_on_by_default_next_to_the_grpc_port(federation: Federation) -> None:
    port = _free_pair()
    federation.start_server(None, port=port)
    assert _bulk_port(federation) == port + 1
    status = admin_client.query(federation.address, federation.operator_token, "GetStatus")
    assert status["bulk"] is not None


def test_a_taken_default_bulk_port_leaves_grpc_serving(federation: Federation) -> None:
    port = _free_pair()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port + 1))
        blocker.listen()
        proc = federation.start_server(None, port=port)
        assert _bulk_port(federation) == 0
        status = admin_client.query(federation.address, federation.operator_token,
                                    "GetStatus")
        assert status["bulk"] is None
    assert "no bulk data path" in proc.text() and "over gRPC only" in proc.text()


def test_a_bulk_port_asked_for_by_number_must_be_had(federation: Federation) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        with pytest.raises(AssertionError, match="bulk port"):
            federation.start_server(None, "--bulk-port", str(taken))
