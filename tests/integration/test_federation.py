"""A real aggregator and real nodes on loopback: a run finishes and the admin JSON is right."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.fixtures.federation import Federation, base_env, cli, write_job


def test_two_nodes_finish_and_admin_json(federation: Federation, tmp_path: Path,
                                         digits_split: list[Path]) -> None:
    job = write_job(tmp_path / "job.toml", rounds=2, min_nodes=2)
    federation.start_server(job, "--heartbeat-s", "1")
    n1 = federation.start_node("node-a", digits_split[0], "--gpu", "none")
    n2 = federation.start_node("node-b", digits_split[1])
    federation.wait_state(("finished", "failed"))

    status = cli("status", "--address", federation.address, "--json")
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)  # stdout is exactly one JSON document
    assert doc["state"] == "finished"
    assert doc["round"] == 2 and doc["rounds"] == 2
    assert doc["nodes"]["registered"] == 2
    assert 0.0 <= doc["accuracy"] <= 1.0

    rounds = json.loads(cli("rounds", "--address", federation.address, "--json").stdout)
    assert [r["round"] for r in rounds["rounds"]] == [1, 2]
    for r in rounds["rounds"]:
        assert r["status"] == "finished"
        assert r["nodes_reporting"] == 2
        assert r["train_loss"] > 0
        assert r["eval"]["nodes"] == 2 and 0 <= r["eval"]["accuracy"] <= 1
        for u in r["updates"]:
            assert u["resources"]["device"] == "cpu"
            assert u["resources"]["rss_peak_mib"] > 50
            assert u["resources"]["nvml_used_peak_mib"] is None
            assert u["gpu_decision"]["device"] == "cpu"
    assert rounds["initial_eval"]["nodes"] == 2
    # Training improves the global model: evaluation after round 2 beats the initial one.
    assert rounds["rounds"][-1]["eval"]["accuracy"] > rounds["initial_eval"]["accuracy"]

    nodes = json.loads(cli("nodes", "--address", federation.address, "--json").stdout)
    by_name = {n["name"]: n for n in nodes["nodes"]}
    assert set(by_name) == {"node-a", "node-b"}
    assert by_name["node-a"]["gpu_decision"]["mode"] == "none"
    assert "GPU" in by_name["node-a"]["gpu_decision"]["reason"] or "gpu" in by_name[
        "node-a"]["gpu_decision"]["reason"]
    assert by_name["node-b"]["gpu_decision"]["mode"] == "offer"
    assert all(n["rounds_completed"] == 2 for n in nodes["nodes"])
    assert all(n["last_resources"]["device"] == "cpu" for n in nodes["nodes"])
    # Each agent stated its training-set size from its data directory at registration, and
    # its updates claimed exactly that.
    from fedgpu.core.datasets import read_meta

    for name, data in (("node-a", digits_split[0]), ("node-b", digits_split[1])):
        assert by_name[name]["stated_examples"] == read_meta(data)["num_train"]
        assert {u["num_examples"] for r in rounds["rounds"] for u in r["updates"]
                if u["node"] == name} == {read_meta(data)["num_train"]}

    # Human tables work against the same server.
    table = cli("rounds", "--address", federation.address)
    assert table.returncode == 0 and "finished" in table.stdout

    # The federation stays up after its job: the nodes stay registered for the next one.
    for n in (n1, n2):
        assert n.popen.poll() is None, n.text()[-2000:]


def test_health_and_reflection(federation: Federation, tmp_path: Path) -> None:
    federation.start_server(write_job(tmp_path / "job.toml"))
    with grpc.insecure_channel(federation.address) as ch:
        # A plain grpc.health.v1 client, as grpc_health_probe or a HEALTHCHECK would be.
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="fedgpu.v1.Federation"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in answers[0].list_services_response.service}
    assert {"fedgpu.v1.Federation", "fedgpu.v1.Admin", "grpc.health.v1.Health"} <= names
    assert cli("health", "--address", federation.address).returncode == 0


def test_wrong_token_is_refused(federation: Federation, tmp_path: Path,
                                digits_split: list[Path]) -> None:
    federation.start_server(write_job(tmp_path / "job.toml"))
    node = federation.start_node("intruder", digits_split[0],
                                 env=base_env(FEDGPU_TOKEN="not-the-token"))
    assert node.popen.wait(timeout=60) == 1
    out = node.text()
    assert "wrong token" in out and "Traceback" not in out
    admin = cli("status", "--address", federation.address, operator_token="nope")
    assert admin.returncode == 1 and "wrong token" in admin.stderr
    assert admin.stdout == ""


def test_a_node_without_the_jobs_task_joins_and_the_job_waits(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    # The federation outlives its jobs: a node lacking this job's task is not refused (the
    # next job may be its), it is left out of this one, which waits saying why.
    federation.start_server(write_job(tmp_path / "job.toml", task="no-such-task",
                                      min_nodes=1), "--heartbeat-s", "1")
    node = federation.start_node("n1", digits_split[0])
    end = time.monotonic() + 60
    while not federation.query("ListNodes")["nodes"] and time.monotonic() < end:
        time.sleep(0.3)
    (job,) = federation.query("ListJobs")
    assert job["state"] == "waiting", job
    assert "no-such-task" in job["reason"] and "not installed" in job["reason"], job
    assert node.popen.poll() is None


def test_unreachable_aggregator(digits_split: list[Path]) -> None:
    from tests.fixtures.federation import free_port

    r = cli("node", "start", "--aggregator", f"127.0.0.1:{free_port()}", "--data",
            str(digits_split[0]), "--connect-timeout", "1")
    assert r.returncode == 1
    assert "cannot reach aggregator" in r.stderr and "Traceback" not in r.stderr
    r = cli("status", "--address", f"127.0.0.1:{free_port()}", "--json")
    assert r.returncode == 1 and r.stdout == ""
    assert re.search(r"cannot reach aggregator at 127\.0\.0\.1:\d+ — is it running\?", r.stderr)


def test_missing_data_dir(tmp_path: Path) -> None:
    r = cli("node", "start", "--aggregator", "127.0.0.1:1", "--data", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert "fedgpu data split" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_job_file(tmp_path: Path) -> None:
    bad = tmp_path / "job.toml"
    bad.write_text('task = "digits"\nrounds = 0\n')
    r = cli("server", "start", "--job", str(bad), "--insecure")
    assert r.returncode == 2 and "'rounds' must be a positive integer" in r.stderr
    assert "Traceback" not in r.stderr
    bad.write_text('task = "digits"\nrounds = 2\nroundz = 3\n')
    r = cli("server", "start", "--job", str(bad), "--insecure")
    assert r.returncode == 2 and "unknown key(s) roundz" in r.stderr
    bad.write_text("task = [broken")
    r = cli("server", "start", "--job", str(bad), "--insecure")
    assert r.returncode == 2 and "not valid TOML" in r.stderr
    r = cli("server", "start", "--job", str(tmp_path / "missing.toml"), "--insecure")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_server_needs_token_or_insecure(tmp_path: Path) -> None:
    r = cli("server", "start", "--job", str(write_job(tmp_path / "job.toml")), token=None)
    assert r.returncode == 2 and "--insecure" in r.stderr


def test_insecure_mode_warns(federation: Federation, tmp_path: Path) -> None:
    proc = federation.start_server(write_job(tmp_path / "job.toml"), "--insecure")
    time.sleep(0.5)
    assert "INSECURE MODE" in proc.text()


def test_bad_flags_are_usage_errors() -> None:
    for args in (["node", "start", "--bogus"],
                 ["node", "start", "--aggregator", "h:1", "--data", ".",
                  "--gpu-min-free-mib", "abc"],
                 ["status", "--address"]):
        r = cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Error:" in r.stderr and "Traceback" not in r.stderr
    r = cli("node", "start", "--aggregator", "h:1", "--data", ".", "--gpu", "sometimes")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --gpu must be one of none, offer, enforce, not 'sometimes'"
    r = cli("node", "start", "--aggregator", "h:1", "--data", ".", "--gpu-memory-fraction", "1.5")
    assert r.returncode == 2 and "(0, 1]" in r.stderr
