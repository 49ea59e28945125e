"""The aggregator as this host sees it: reachable, healthy, accepting our credential, and when
it is not, why (a TLS failure is named with its fix, not called an outage)."""

from __future__ import annotations

from typing import Any

from fedgpu.cli.doctor.result import FAIL, OK, WARN, Check
from fedgpu.core.errors import FedgpuError


def _node_credential(address: str, token: str | None, tls: Any) -> str | None:
    """None when the aggregator accepts this node's token / certificate, else why not: a
    heartbeat for no node is what a node's credential may always send."""
    import grpc

    from fedgpu.core.transport import channel, token_metadata
    from fedgpu.proto import pb, pb_grpc

    with channel(address, tls) as ch:
        try:
            pb_grpc.FederationStub(ch).Heartbeat(pb.HeartbeatRequest(node_id=""),
                                                 metadata=token_metadata(token), timeout=5)
        except grpc.RpcError as exc:
            return exc.details() or exc.code().name
    return None


def aggregator_check(address: str, token: str | None, tls: Any,
                     operator_token: str | None = None) -> Check:
    from fedgpu.core import admin_client, tls_diagnosis

    name = "aggregator"
    try:
        state = admin_client.health(address, tls=tls)
    except FedgpuError as exc:
        if tls_diagnosis.diagnose(address, tls) is not None:
            # A TLS mismatch or a wrong port: the line names the cause and its fix already.
            return Check(name, FAIL, str(exc))
        return Check(name, FAIL, str(exc), "start the aggregator (fedgpu up, or fedgpu server "
                     "start) and check --address, the port mapping and firewalls")
    if state != "SERVING":
        return Check(name, FAIL, f"aggregator at {address} answers health {state}",
                     "read its log (fedgpu logs aggregator)")
    detail = f"aggregator at {address} is SERVING"
    if operator_token is None:
        if token is None and not (tls is not None and tls.mutual):
            return Check(name, OK, detail + " (no token given: credentials not checked)")
        refused = _node_credential(address, token, tls)
        if refused is not None:
            return Check(name, WARN, f"{detail}, but it refuses this node's credential: "
                         f"{refused}", "check --token / FEDGPU_TOKEN and the --tls-* client "
                         "certificate")
        return Check(name, OK, detail + "; it accepts this node's credential (the run's "
                     "state needs the operator token)")
    try:
        st = admin_client.query(address, operator_token, "GetStatus", tls=tls, timeout=5)
    except FedgpuError as exc:
        return Check(name, WARN, f"{detail}, but the Admin service refused us: {exc}",
                     "check --operator-token / FEDGPU_OPERATOR_TOKEN and the --tls-* client "
                     "certificate")
    detail += (f"; job {st.get('job_id') or '-'} {st['state']}, round "
               f"{st['round']}/{st['rounds']}, {st['nodes']['alive']} node(s) alive")
    if st["state"] == "failed":
        return Check(name, FAIL, f"{detail}: {st['error']}", "read fedgpu logs aggregator")
    return Check(name, OK, detail)
