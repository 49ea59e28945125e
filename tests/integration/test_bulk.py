"""The bulk data path on a real aggregator: weights over the bulk port with mutual TLS, a node
that cannot reach that port falling back to gRPC by itself, and the port's refusals (forged,
reused and other sites' tickets, truncated streams, idle connections) leaving the model as
it was."""

from __future__ import annotations

import json
import secrets
import ssl
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedgpu.core import bulk, certs, codec, digests
from fedgpu.core.tls import TlsFiles, channel_credentials
from fedgpu.core.transport import token_metadata
from fedgpu.proto import pb, pb_grpc
from tests.fixtures.bulk_wire import (  # noqa: F401 - wire_fixture is the `wire` fixture
    GLOBAL,
    Wire,
    closed_by_peer,
    wait_for,
    wire_fixture,
)
from tests.fixtures.federation import Federation, free_port, job_dir, write_job
from tests.fixtures.forwarder import GrpcOnlyForwarder


def flags(t: TlsFiles) -> list[str]:
    return ["--tls-cert", str(t.cert), "--tls-key", str(t.key), "--tls-ca", str(t.ca)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    ours = tmp_path_factory.mktemp("pki")
    certs.init_ca(ours)
    server = certs.issue_server(ours)
    out = {"server": TlsFiles(server.cert, server.key, server.ca)}
    for name in ("site-a", "site-b"):
        i = certs.issue_node(ours, name)
        out[name] = TlsFiles(i.cert, i.key, i.ca)
    op = certs.issue_operator(ours)
    out["operator"] = TlsFiles(op.cert, op.key, op.ca)
    return out


def test_weights_move_over_the_bulk_port_with_mutual_tls(
        federation: Federation, tmp_path: Path, digits_split: list[Path],
        pki: dict[str, TlsFiles]) -> None:
    job = write_job(tmp_path / "job.toml", rounds=2, min_nodes=2, round_deadline_s=120)
    federation.tls = pki["operator"]
    bulk_port = free_port()
    server = federation.start_server(job, "--bulk-port", str(bulk_port), *flags(pki["server"]))
    assert f"bulk data path on port {bulk_port}" in server.text()
    for name, data in (("site-a", digits_split[0]), ("site-b", digits_split[1])):
        federation.start_node(name, data, *flags(pki[name]))
    federation.wait_state(("finished",))

    rounds = federation.query("ListRounds")["rounds"]
    train = [u for r in rounds if r["round"] >= 1 for u in r["updates"]]
    assert len(train) == 4 and {u["transport"] for u in train} == {"bulk"}, train
    assert all(u["upload_s"] > 0 for u in train)
    nodes = federation.query("ListNodes")["nodes"]
    assert {(n["name"], n["transport"], n["bulk_error"]) for n in nodes} == {
        ("site-a", "bulk", None), ("site-b", "bulk", None)}
    status = federation.query("GetStatus")
    stats = status["bulk"]
    assert stats["port"] == bulk_port and stats["tls"] == "mutual"
    # Init model in; per training round two models out and two updates in.
    assert stats["downloads"] >= 4 and stats["uploads"] >= 5, stats
    assert stats["refused"] == {}
    for name in ("site-a", "site-b"):
        assert "moving weights over gRPC" not in (tmp_path / f"{name}.log").read_text()



def test_a_ticket_presented_with_another_sites_certificate_is_refused(
        federation: Federation, tmp_path: Path, pki: dict[str, TlsFiles]) -> None:
    init = tmp_path / "init.safetensors"
    init.write_bytes(codec.encode(GLOBAL).to_bytes())
    job = write_job(tmp_path / "job.toml", rounds=1, min_nodes=1, round_deadline_s=120,
                    evaluate=False, initial_weights=str(init))
    federation.tls = pki["operator"]
    bulk_port = free_port()
    federation.start_server(job, "--bulk-port", str(bulk_port), *flags(pki["server"]))
    with grpc.secure_channel(federation.address, channel_credentials(pki["site-a"])) as ch:
        stub = pb_grpc.FederationStub(ch)
        md = token_metadata(federation.token)
        reg = stub.Register(pb.RegisterRequest(node_name="site-a", tasks=["digits"]),
                            metadata=md, timeout=10)

        def task() -> pb.TaskHeader:
            for _ in range(30):
                for msg in stub.PullTask(pb.PullTaskRequest(node_id=reg.node_id, wait_s=5,
                                                            bulk=True), metadata=md,
                                         timeout=60):
                    if msg.header.kind == pb.TASK_KIND_TRAIN:
                        return msg.header
            raise AssertionError("no task was offered")

        first = task()
        algo, digest = digests.of_header(first)
        asm = codec.Assembler(first.payload_size, digest, 1 << 20, algo)
        with pytest.raises(bulk.RefusedError, match="certificate for site-b") as err:
            bulk.download("localhost", bulk_port, pki["site-b"], first.bulk.ticket, asm)
        assert err.value.status.reason == "wrong_peer"
        # Without a client certificate the TLS handshake itself fails (under TLS 1.3 the
        # client learns it with its first write).
        with pytest.raises((bulk.BulkUnreachable, ssl.SSLError)):
            bulk.download("localhost", bulk_port, TlsFiles(ca=pki["site-a"].ca),
                          task().bulk.ticket, asm)
        # The site's own certificate, with a ticket asked for again, gets the model.
        bulk.download("localhost", bulk_port, pki["site-a"], task().bulk.ticket, asm)
        got, _ = codec.decode(asm.finish())
        assert np.array_equal(got["w"], GLOBAL["w"])
    refused = federation.query("GetStatus")["bulk"]["refused"]
    assert refused["wrong_peer"] == 1 and refused["handshake"] == 1, refused


# ---- a bulk port the node cannot reach --------------------------------------------------


def test_a_node_that_cannot_reach_the_bulk_port_falls_back_to_grpc(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    job = write_job(tmp_path / "job.toml", rounds=2, min_nodes=1, round_deadline_s=120)
    bulk_port = free_port()
    federation.start_server(job, "--bulk-port", str(bulk_port))
    port = int(federation.address.rsplit(":", 1)[1])
    fw = GrpcOnlyForwarder(("127.0.0.1", port))
    try:
        federation.spawn("site-c", ["node", "start", "--aggregator", f"127.0.0.2:{fw.port}",
                                    "--data", str(digits_split[2]), "--name", "site-c",
                                    "--torch-threads", "1"])
        federation.wait_state(("finished",))
    finally:
        fw.close()
    rounds = federation.query("ListRounds")["rounds"]
    train = [u for r in rounds if r["round"] >= 1 for u in r["updates"]]
    assert len(train) == 2 and {u["transport"] for u in train} == {"grpc"}, train
    (node,) = federation.query("ListNodes")["nodes"]
    assert node["transport"] == "grpc"
    assert f"127.0.0.2:{bulk_port}" in node["bulk_error"], node["bulk_error"]
    log = (tmp_path / "site-c.log").read_text()
    # Said once, though the node moved four payloads after it.
    assert log.count("moving weights over gRPC from now on") == 1, log[-3000:]
    assert federation.query("GetStatus")["bulk"]["uploads"] == 0


# ---- the port's refusals, with a raw client ---------------------------------------------



def test_a_download_ticket_serves_once_and_forged_ones_not_at_all(wire: Wire) -> None:
    task = wire.task()
    assert task.HasField("bulk") and task.bulk.port == wire.bulk_port
    algo, digest = digests.of_header(task)
    assert algo is codec.WIRE_DIGEST
    asm = codec.Assembler(task.payload_size, digest, 1 << 20, algo)
    landed: list[int] = []  # what the node's progress lines count (node/transfer_log.py)
    bulk.download("127.0.0.1", wire.bulk_port, None, task.bulk.ticket, asm,
                  on_bytes=landed.append)
    assert sum(landed) == task.payload_size
    got, _ = codec.decode(asm.finish())
    assert all(np.array_equal(got[k], GLOBAL[k]) for k in GLOBAL)
    # Counted as the port sent it: the open round shows the finished download and its rate.
    last = wait_for(lambda: next((s["last"] for s in (wire.fed.query("ListRounds").get("open")
                                                       or {}).get("sites", []) if "last" in s),
                                 None), what="the download in the open round")
    assert last["direction"] == "down" and last["bytes"] == task.payload_size, last
    assert last["rate_bytes_per_s"] > 0
    before = dict(wire.status()["bulk"]["refused"])

    again = codec.Assembler(task.payload_size, digest, 1 << 20, algo)
    with pytest.raises(bulk.RefusedError, match="already used") as used:
        bulk.download("127.0.0.1", wire.bulk_port, None, task.bulk.ticket, again)
    assert used.value.status.reason == "used"
    with pytest.raises(bulk.RefusedError, match="not one this aggregator issued") as forged:
        bulk.download("127.0.0.1", wire.bulk_port, None, secrets.token_urlsafe(32), again)
    assert forged.value.status.reason == "unknown"
    refused = wire.status()["bulk"]["refused"]
    assert refused.get("used", 0) == before.get("used", 0) + 1
    assert refused.get("unknown", 0) == before.get("unknown", 0) + 1
    # Not a bulk conversation at all: refused and counted too.
    with wire.connect() as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert closed_by_peer(s)
    wait_for(lambda: wire.status()["bulk"]["refused"].get("malformed", 0)
             == before.get("malformed", 0) + 1, what="malformed refusal counted")


def test_an_upload_ticket_cannot_be_used_after_its_verdict(wire: Wire) -> None:
    task = wire.task()
    enc = codec.encode({k: v * 0 + 1 for k, v in GLOBAL.items()})
    ticket = wire.stub.OpenUpload(wire.header(task, enc), metadata=wire.md, timeout=10)
    # Other bytes than the header announced: a verdict (refused by digest) spends the ticket.
    other = codec.encode({k: v * 0 + 2 for k, v in GLOBAL.items()})
    verdict = bulk.upload("127.0.0.1", wire.bulk_port, None, ticket.ticket, other.segments)
    assert not verdict.ok and verdict.reason == "digest"
    status = bulk.upload("127.0.0.1", wire.bulk_port, None, ticket.ticket, enc.segments)
    assert not status.ok and status.reason == "used" and status.code == "PERMISSION_DENIED"


def test_a_good_bulk_upload_finishes_the_round(wire: Wire) -> None:
    task = wire.task()
    before = wire.global_digest()
    update = {k: v * 3 for k, v in GLOBAL.items()}
    enc = codec.encode(update)
    ticket = wire.stub.OpenUpload(wire.header(task, enc), metadata=wire.md, timeout=10)
    status = bulk.upload("127.0.0.1", wire.bulk_port, None, ticket.ticket, enc.segments)
    assert status.ok, status
    wire.fed.wait_state(("finished",), timeout=60)
    assert wire.global_digest() != before
    model = codec.read_file(job_dir(wire.state_dir) / "global.safetensors")
    assert all(np.array_equal(model[k], update[k]) for k in update)
    (rec,) = [r for r in wire.fed.query("ListRounds")["rounds"] if r["status"] == "finished"]
    (up,) = rec["updates"]
    assert up["transport"] == "bulk" and up["upload_s"] > 0
    assert json.dumps(rec)  # strict JSON


def test_half_precision_on_the_wire_keeps_a_float32_model(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    job = write_job(tmp_path / "job.toml", rounds=2, min_nodes=1, round_deadline_s=120,
                    wire_dtype="bf16")
    state = tmp_path / "state"
    federation.start_server(job, "--bulk-port", str(free_port()), "--state-dir", str(state))
    federation.start_node("site-a", digits_split[0])
    status = federation.wait_state(("finished",))
    assert status["job"]["wire_dtype"] == "bf16" and status["accuracy"] is not None
    model = codec.read_file(job_dir(state) / "global.safetensors")
    f32 = sum(a.nbytes for a in model.values() if a.dtype == np.float32)
    assert f32 and all(a.dtype != np.dtype("V2") for a in model.values())
    assert {codec.dtype_name(a.dtype) for a in model.values()} <= {"F32", "I64"}
    rounds = federation.query("ListRounds")["rounds"]
    for rec in (r for r in rounds if r["round"] >= 1):
        # The update came in bfloat16: about half the float32 bytes.
        assert rec["bytes_received"] < 0.6 * f32, (rec["bytes_received"], f32)
        assert rec["updates"][0]["transport"] == "bulk"


def test_the_aggregator_stops_at_once_with_a_bulk_upload_stalled(
        federation: Federation, tmp_path: Path) -> None:
    init = tmp_path / "init.safetensors"
    init.write_bytes(codec.encode(GLOBAL).to_bytes())
    job = write_job(tmp_path / "job.toml", rounds=1, min_nodes=1, round_deadline_s=300,
                    evaluate=False, initial_weights=str(init))
    bulk_port = free_port()
    server = federation.start_server(job, "--bulk-port", str(bulk_port),
                                     "--upload-idle-s", "120")
    md = token_metadata(federation.token)
    with grpc.insecure_channel(federation.address) as ch:
        stub = pb_grpc.FederationStub(ch)
        reg = stub.Register(pb.RegisterRequest(node_name="slow", tasks=["digits"]),
                            metadata=md, timeout=10)
        wire = Wire(federation, tmp_path, stub, reg.node_id, bulk_port)
        task = wire.task(use_bulk=False)
        enc = codec.encode(GLOBAL)
        ticket = stub.OpenUpload(wire.header(task, enc), metadata=md, timeout=10)
    with wire.connect() as s:
        bulk.send_ticket(s, ticket.ticket)
        assert bulk.read_status(s).ok
        s.sendall(enc.to_bytes()[:10])  # and then nothing: its reader waits up to 120 s
        wait_for(lambda: federation.query("GetStatus")["uploads"]["in_flight"] == 1,
                 what="upload in flight")
        t0 = time.monotonic()
        server.popen.terminate()
        assert server.popen.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 20, "the stalled reader held the aggregator up"
