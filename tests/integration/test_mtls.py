"""Mutual TLS on a real aggregator: who is let in, who is refused, and what each side says."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest

from fedgpu.core import certs
from fedgpu.core.tls import TlsFiles, channel_credentials
from fedgpu.core.transport import token_metadata
from fedgpu.proto import pb, pb_grpc
from tests.fixtures.federation import (
    Federation,
    Proc,
    base_env,
    cli,
    write_job,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    ours = tmp_path_factory.mktemp("pki")
    certs.init_ca(ours)
    server = certs.issue_server(ours)
    theirs = tmp_path_factory.mktemp("other-ca")
    certs.init_ca(theirs)
    out = {"server": TlsFiles(server.cert, server.key, server.ca)}
    for name in ("node-a", "node-b"):
        i = certs.issue_node(ours, name)
        out[name] = TlsFiles(i.cert, i.key, i.ca)
    op = certs.issue_operator(ours)
    out["operator"] = TlsFiles(op.cert, op.key, op.ca)
    # A node certificate that merely carries the name "operator": its role is node.
    named = certs.issue_node(ours, "operator")
    out["node-named-operator"] = TlsFiles(named.cert, named.key, named.ca)
    forged = certs.issue_node(theirs, "node-a")
    # A certificate for the right name from the wrong CA, next to our CA as trust anchor.
    out["foreign"] = TlsFiles(forged.cert, forged.key, out["node-a"].ca)
    return out


def flags(t: TlsFiles) -> list[str]:
    out = []
    for flag, path in (("--tls-cert", t.cert), ("--tls-key", t.key), ("--tls-ca", t.ca)):
        if path is not None:
            out += [flag, str(path)]
    return out




def one_line_error(proc_text: str, expected: str) -> None:
    errors = [line for line in proc_text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], proc_text[-2000:]
    assert "Traceback" not in proc_text


def test_mtls_admits_certified_nodes_and_refuses_the_rest(
        federation: Federation, tmp_path: Path, digits_split: list[Path],
        pki: dict[str, TlsFiles]) -> None:
    job = write_job(tmp_path / "job.toml", rounds=1, min_nodes=1, round_deadline_s=60)
    federation.tls = pki["operator"]
    server = federation.start_server(job, "--heartbeat-s", "1", *flags(pki["server"]))
    assert "mutual TLS" in server.text()

    data = digits_split[0]

    def node(label: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        # Own log per process: two attempts may claim the same node name.
        return federation.spawn(label, ["node", "start", "--aggregator", federation.address,
                                        "--data", str(data), "--torch-threads", "1",
                                        "--status-file", str(tmp_path / f"{label}.status"),
                                        *args], env=env)

    # Refused: no certificate, another CA's certificate, another node's name, a wrong token,
    # and a node that does not speak TLS at all. Each exits 1 with one line saying why.
    no_cert = node("nocert", "--name", "node-a", "--tls-ca", str(pki["node-a"].ca))
    foreign = node("foreign", "--name", "node-a", *flags(pki["foreign"]))
    impostor = node("impostor", "--name", "node-a", *flags(pki["node-b"]))
    bad_token = node("badtoken", *flags(pki["node-b"]),
                     env=base_env(FEDGPU_TOKEN="not-the-token"))
    plain = node("plain", "--name", "node-a", "--connect-timeout", "20")
    for proc in (no_cert, foreign, impostor, bad_token, plain):
        assert proc.popen.wait(timeout=60) == 1, proc.text()[-2000:]
    one_line_error(no_cert.text(), "requires a client certificate")
    one_line_error(foreign.text(), "refused our client certificate")
    one_line_error(impostor.text(), "this client certificate is for node-b")
    one_line_error(bad_token.text(), "wrong token")
    one_line_error(plain.text(), "speaks TLS and we do not")
    log = server.text()
    # The TLS layer refuses the first two in the handshake and logs why; we log the others.
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in log
    assert "CERTIFICATE_VERIFY_FAILED" in log
    assert "certificate is for node-b, not 'node-a'" in log
    assert "wrong token" in log
    assert federation.query("GetStatus")["nodes"]["registered"] == 0

    # With its own certificate (and no --name: it defaults to the certificate's) a node joins
    # and the run completes.
    good = node("good", *flags(pki["node-a"]))
    federation.wait_state(("finished",), timeout=120)
    # The federation stays up: the node stays registered for the next job.
    assert good.popen.poll() is None, good.text()[-2000:]

    # The admin CLI works over mTLS with an operator certificate, and not without one.
    ok = cli("status", "--json", "--address", federation.address, *flags(pki["operator"]))
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["state"] == "finished" and doc["nodes"]["registered"] == 1
    names = json.loads(cli("nodes", "--json", "--address", federation.address,
                           *flags(pki["operator"])).stdout)
    assert [n["name"] for n in names["nodes"]] == ["node-a"]
    assert cli("health", "--address", federation.address,
               *flags(pki["operator"])).returncode == 0
    refused = cli("rounds", "--json", "--address", federation.address,
                  "--tls-ca", str(pki["operator"].ca))
    assert refused.returncode == 1 and refused.stdout == ""
    assert "requires a client certificate" in refused.stderr


def test_node_ids_are_bound_to_the_certificate(federation: Federation, tmp_path: Path,
                                               pki: dict[str, TlsFiles]) -> None:
    job = write_job(tmp_path / "job.toml", rounds=1, min_nodes=2, round_deadline_s=60)
    federation.tls = pki["operator"]
    federation.start_server(job, *flags(pki["server"]))
    md = token_metadata(federation.token)

    def stub(files: TlsFiles) -> tuple[grpc.Channel, pb_grpc.FederationStub]:
        ch = grpc.secure_channel(federation.address, channel_credentials(files))
        return ch, pb_grpc.FederationStub(ch)

    ch_b, as_b = stub(pki["node-b"])
    ch_a, as_a = stub(pki["node-a"])
    with ch_a, ch_b:
        node_b = as_b.Register(pb.RegisterRequest(node_name="node-b", tasks=["digits"]),
                               metadata=md, timeout=10).node_id
        # node-a's certificate may not use node-b's id for anything.
        calls = {
            "Heartbeat": lambda: as_a.Heartbeat(pb.HeartbeatRequest(node_id=node_b),
                                                metadata=md, timeout=10),
            "PullTask": lambda: list(as_a.PullTask(
                pb.PullTaskRequest(node_id=node_b, wait_s=0), metadata=md, timeout=10)),
            "PushUpdate": lambda: as_a.PushUpdate(iter([pb.UpdateChunk(header=pb.UpdateHeader(
                node_id=node_b, round=1, kind=pb.TASK_KIND_TRAIN, failed=True,
                error="x"))]), metadata=md, timeout=10),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert "this client certificate is for node-a" in err.value.details(), name
        # Its owner still can.
        assert as_b.Heartbeat(pb.HeartbeatRequest(node_id=node_b), metadata=md,
                              timeout=10).known


def test_refused_calls_do_not_keep_another_node_alive(federation: Federation, tmp_path: Path,
                                                      pki: dict[str, TlsFiles]) -> None:
    # node-b registers and goes silent; node-a's certificate keeps calling with node-b's id.
    # Every such call is refused, and none of them may count as node-b being alive.
    job = write_job(tmp_path / "job.toml", rounds=1, min_nodes=3, round_deadline_s=60)
    federation.tls = pki["operator"]
    federation.start_server(job, "--heartbeat-s", "1", *flags(pki["server"]))
    md = token_metadata(federation.token)
    ch_a = grpc.secure_channel(federation.address, channel_credentials(pki["node-a"]))
    ch_b = grpc.secure_channel(federation.address, channel_credentials(pki["node-b"]))
    with ch_a, ch_b:
        as_a, as_b = pb_grpc.FederationStub(ch_a), pb_grpc.FederationStub(ch_b)
        node_b = as_b.Register(pb.RegisterRequest(node_name="node-b", tasks=["digits"]),
                               metadata=md, timeout=10).node_id
        # The loss limit is three heartbeats plus 2 s (5 s here); keep at it for twice that.
        end = time.monotonic() + 10
        refused = 0
        while time.monotonic() < end:
            for call in (
                lambda: list(as_a.PullTask(pb.PullTaskRequest(node_id=node_b, wait_s=0),
                                           metadata=md, timeout=10)),
                lambda: as_a.PushUpdate(iter([pb.UpdateChunk(header=pb.UpdateHeader(
                    node_id=node_b, round=1, kind=pb.TASK_KIND_TRAIN, failed=True,
                    error="x"))]), metadata=md, timeout=10),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                refused += 1
            time.sleep(0.2)
        (b,) = federation.query("ListNodes")["nodes"]
    assert refused > 10
    assert b["name"] == "node-b" and b["alive"] is False and b["state"] == "lost", b
    assert b["last_seen_s"] >= 9
    assert federation.query("GetStatus")["nodes"]["alive"] == 0


def test_roles_come_from_the_certificate(federation: Federation, tmp_path: Path,
                                         pki: dict[str, TlsFiles]) -> None:
    """An operator certificate cannot register as a node; a node certificate (even one named
    "operator") cannot operate, and may see only itself in ListNodes."""
    from fedgpu.core import admin_client
    from fedgpu.core.errors import FedgpuError
    from fedgpu.proto import admin_pb2, admin_pb2_grpc

    federation.tls = pki["operator"]
    federation.start_server(None, *flags(pki["server"]))
    md = token_metadata(federation.token)

    def channel(files: TlsFiles) -> grpc.Channel:
        return grpc.secure_channel(federation.address, channel_credentials(files))

    with channel(pki["operator"]) as op, channel(pki["node-a"]) as a, \
            channel(pki["node-b"]) as b, channel(pki["node-named-operator"]) as fake:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.FederationStub(op).Register(
                pb.RegisterRequest(node_name="operator", tasks=["digits"]),
                metadata=token_metadata(federation.operator_token), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "operator credential cannot act as a node" in err.value.details()
        for stub in (a, b):
            name = "node-a" if stub is a else "node-b"
            pb_grpc.FederationStub(stub).Register(
                pb.RegisterRequest(node_name=name, tasks=["digits"]), metadata=md, timeout=10)
        for ch in (a, fake):
            admin = admin_pb2_grpc.AdminStub(ch)
            for method, request in (("GetStatus", admin_pb2.GetStatusRequest()),
                                    ("ListJobs", admin_pb2.ListJobsRequest())):
                with pytest.raises(grpc.RpcError) as err:
                    getattr(admin, method)(request, metadata=md, timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "needs the operator credential" in err.value.details()
        mine = json.loads(admin_pb2_grpc.AdminStub(a).ListNodes(
            admin_pb2.ListNodesRequest(), metadata=md, timeout=10).json)
        assert [n["name"] for n in mine["nodes"]] == ["node-a"]
    everyone = federation.query("ListNodes")
    assert sorted(n["name"] for n in everyone["nodes"]) == ["node-a", "node-b"]
    with pytest.raises(FedgpuError, match="operator credential"):
        admin_client.query(federation.address, federation.token, "GetStatus",
                           tls=pki["node-a"])


def test_the_health_port_answers_probes_without_a_certificate_and_nothing_else(
        federation: Federation, pki: dict[str, TlsFiles]) -> None:
    """What Kubernetes' native grpc: probe does: plaintext, no client certificate."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fedgpu.proto import admin_pb2, admin_pb2_grpc
    from tests.fixtures.federation import free_port

    probe = free_port()
    federation.tls = pki["operator"]
    federation.start_server(None, "--health-port", str(probe), *flags(pki["server"]))
    with grpc.insecure_channel(f"127.0.0.1:{probe}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                     timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for call in (lambda: admin_pb2_grpc.AdminStub(ch).GetStatus(
                         admin_pb2.GetStatusRequest(), timeout=10),
                     lambda: pb_grpc.FederationStub(ch).Register(
                         pb.RegisterRequest(node_name="x"), timeout=10)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The main port still requires mutual TLS.
    host, port = federation.address.split(":")
    with grpc.insecure_channel(f"{host}:{port}") as ch, pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
