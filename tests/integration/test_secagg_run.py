"""Secure aggregation with real processes: `fedgpu run` of a secure job (nodes' masked inputs
over the bulk port), and an aggregator with three real nodes and a fourth, scripted over the
real gRPC wire, that drops out at a different stage of the protocol each round: every round
still finishes, and `fedgpu rounds --json` names the stage and counts what was recovered."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np

import fedgpu
from fedgpu.core import certs, codec
from fedgpu.core.secagg.errors import Stage
from fedgpu.core.secagg.messages import KeyRelay, Setup, ShareRelay, UnmaskRequest
from fedgpu.core.secagg.site import SiteSession
from fedgpu.core.tls import TlsFiles
from fedgpu.node.client import AggregatorClient
from fedgpu.proto import pb
from tests.fixtures.federation import (
    FEDGPU,
    ROOT,
    Federation,
    base_env,
    free_port,
    write_job,
)

SECURE_JOB = """task = "digits"
rounds = 2
min_nodes = 3
round_deadline_s = 120

[secure_aggregation]
neighbours = "all"
clip = 1.0
"""


def test_fedgpu_run_with_secure_aggregation(tmp_path: Path) -> None:
    job = tmp_path / "secure.toml"
    job.write_text(SECURE_JOB)
    run_dir = tmp_path / "run"
    r = subprocess.run([*FEDGPU, "run", "--nodes", "3", "--rounds", "2", "--job", str(job),
                        "--run-dir", str(run_dir), "--gpu", "none"], capture_output=True,
                       text=True, env=base_env(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    for i in (1, 2):
        # The sites' losses travel masked: the round shows their examples-weighted mean.
        assert re.search(rf"round {i}/2: finished, train loss \d+\.\d+, 3/3 nodes", r.stdout)
    assert float(re.search(r"final global model: accuracy ([\d.]+)", r.stdout).group(1)) >= 0.8
    rounds = json.loads((run_dir / "rounds.json").read_text())["rounds"]
    for rnd in rounds:
        sa = rnd["secure_aggregation"]
        assert (sa["sites"], sa["masked"], sa["dropped"], sa["recovered"]) == (3, 3, {}, 0)
        assert sa["threshold"] == 2 and sa["protocol_s"] > 0
        assert sa["signed"] is False  # tokens only: the honest-but-curious model
        # ring_bits = "auto": 3 sites of under 512 digits each (stated at registration)
        # bound the sum well inside Z_2^32.
        assert (sa["ring_bits"], sa["max_weight"]) == (32, 512), sa
        # The example counts stay with the sites; the aggregator learns their total only.
        assert all(u["num_examples"] == 0 for u in rnd["updates"])
        # Nothing per site in the clear (node/clear_fields.py): no loss, examples, steps.
        assert all(u["train_metrics"] == {} for u in rnd["updates"]), rnd["updates"]
        # ... they came out of the masked vector as sums over the three sites only.
        sums = rnd["masked_metrics"]
        assert {k: v["sites"] for k, v in sums.items()} == {
            "loss": 3, "examples": 3, "steps": 3, "examples_per_s": 3, "eval_loss": 3,
            "eval_accuracy": 3, "num_eval_examples": 3}
        assert 0 < rnd["train_loss"] == sums["loss"]["value"] < 5
        assert rnd["num_examples"] == sums["examples"]["value"] == sa["total_weight"] > 0
        assert sums["steps"]["value"] >= 3 and sums["examples_per_s"]["value"] > 0
        assert all(u["eval_metrics"] == {} and u["num_eval_examples"] == 0
                   for u in rnd["updates"]), rnd["updates"]
        assert {u["transport"] for u in rnd["updates"]} == {"bulk"}
    # The evaluation of round 1's model (sent by round 2's sites) is one masked sum of three.
    (entry,) = rounds[0]["eval"]["per_node"]
    assert entry["node"] == "3 sites (masked sum)" and entry["num_examples"] == 360
    assert 0.7 < rounds[0]["eval"]["accuracy"] == entry["metrics"]["accuracy"] <= 1


# Round -> the stage the scripted site drops at.
DROPS = {1: Stage.ADVERTISE_KEYS, 2: Stage.SHARE_KEYS, 3: Stage.MASKED_INPUT, 4: Stage.UNMASK}


KIND = {Stage.ADVERTISE_KEYS: pb.TASK_KIND_SECAGG_ADVERTISE_KEYS,
        Stage.SHARE_KEYS: pb.TASK_KIND_SECAGG_SHARE_KEYS,
        Stage.MASKED_INPUT: pb.TASK_KIND_SECAGG_MASKED_INPUT,
        Stage.UNMASK: pb.TASK_KIND_SECAGG_UNMASK}


class _Wire:
    """The dropper's side of the wire, by hand: each message an update of its stage's kind,
    each relay a task of the next stage's kind (what node/secagg.py does for real nodes)."""

    def __init__(self, client: AggregatorClient, node_id: str, workdir: Path,
                 stop: threading.Event) -> None:
        self.client, self.node_id, self.workdir, self.stop = client, node_id, workdir, stop

    def send(self, task: pb.TaskHeader, stage: Stage, data: bytes | bytearray,
             **fields: object) -> None:
        path = self.workdir / "dropper.bin"
        path.write_bytes(data)
        self.client.push(pb.UpdateHeader(node_id=self.node_id, task_id=task.task_id,
                                         round=task.round, kind=KIND[stage], **fields), path)

    def wait(self, task: pb.TaskHeader, stage: Stage) -> bytes:
        while not self.stop.is_set():
            header, payload = self.client.pull(self.node_id, 1, 1 << 30)
            if header.task_id == task.task_id and header.kind == KIND[stage]:
                return bytes(payload or b"")
        raise RuntimeError("stopped")


def _dropper(address: str, token: str, workdir: Path, stop: threading.Event,
             errors: list[BaseException], drops: dict[tuple[int, int], Stage]) -> None:
    """A site that trains instantly and leaves the protocol of the n-th task it gets for
    round r at drops[(r, n)]."""
    seen: dict[int, int] = {}
    try:
        client = AggregatorClient(address, token)
        reply = client.register(pb.RegisterRequest(
            node_name="dropper", version=fedgpu.__version__, tasks=["digits"],
            num_examples=500))
        client.bulk.reset(0)  # this one speaks over gRPC; the real nodes use the bulk port
        wire = _Wire(client, reply.node_id, workdir, stop)
        while not stop.is_set():
            task, payload = client.pull(reply.node_id, 1, 1 << 30)
            if task.kind in (pb.TASK_KIND_NONE, pb.TASK_KIND_SHUTDOWN):
                continue
            if task.kind == pb.TASK_KIND_TRAIN:
                seen[task.round] = seen.get(task.round, 0) + 1
            drop = drops.get((task.round, seen.get(task.round, 0)))
            if task.kind != pb.TASK_KIND_TRAIN or drop == Stage.ADVERTISE_KEYS:
                # Leaves the initial model to a real node; "fails training" in round 1.
                client.push(pb.UpdateHeader(node_id=reply.node_id, task_id=task.task_id,
                                            round=task.round, kind=task.kind, failed=True,
                                            error="scripted dropout"), None)
                continue
            assert task.secagg_setup and payload is not None
            base = codec.decode(payload)[0]
            change = np.full(sum(a.size for a in base.values()), 0.001, dtype=np.float32)
            site = SiteSession(Setup.decode(task.secagg_setup))
            wire.send(task, Stage.ADVERTISE_KEYS, site.advertise().encode())
            relay = KeyRelay.decode(wire.wait(task, Stage.SHARE_KEYS))
            if drop == Stage.SHARE_KEYS:
                continue
            wire.send(task, Stage.SHARE_KEYS, site.share_keys(relay).encode())
            shares = ShareRelay.decode(wire.wait(task, Stage.MASKED_INPUT))
            if drop == Stage.MASKED_INPUT:
                continue
            masked = site.masked_input(shares, change, 500)
            wire.send(task, Stage.MASKED_INPUT, masked.encode(), train_metrics={"loss": 1.0})
            request = UnmaskRequest.decode(wire.wait(task, Stage.UNMASK))
            if drop == Stage.UNMASK:
                continue  # its input is in, its shares never come
            wire.send(task, Stage.UNMASK, site.unmask(request).encode())
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        if not stop.is_set():
            errors.append(exc)


def test_a_site_dropping_at_each_stage_is_recovered(federation: Federation,
                                                    digits_split: list[Path]) -> None:
    job = write_job(federation.tmp / "job.toml", rounds=4, min_nodes=3,
                    min_available_nodes=4, evaluate=False, round_deadline_s=60,
                    secure_aggregation={"stage_timeout_s": 3})
    federation.start_server(job, "--state-dir", str(federation.tmp / "state"),
                            "--bulk-port", str(free_port()))
    for i, data in enumerate(digits_split):
        federation.start_node(f"node-{i + 1}", data, "--gpu", "none")
    stop, errors = threading.Event(), []
    drops = {(r, 1): stage for r, stage in DROPS.items()}
    thread = threading.Thread(target=_dropper, args=(federation.address, federation.token,
                                                     federation.tmp, stop, errors, drops))
    thread.start()
    try:
        federation.wait_state(("finished", "failed"), timeout=300)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not errors, errors
    doc = federation.query("ListRounds")
    rounds = {r["round"]: r for r in doc["rounds"] if r["status"] == "finished"}
    assert sorted(rounds) == [1, 2, 3, 4], json.dumps(doc, indent=1)[:3000]
    for number, stage in DROPS.items():
        sa = rounds[number]["secure_aggregation"]
        assert sa["sites"] == 4
        assert sa["dropped"] == {str(stage): ["dropper"]}, sa
        assert sa["masked"] == (4 if stage == Stage.UNMASK else 3)
        assert sa["recovered"] == (1 if stage == Stage.MASKED_INPUT else 0)
    # Round 4 counted the dropper's masked input, sent over gRPC.
    transports = {u["node"]: u["transport"] for u in rounds[4]["updates"]}
    assert transports == {"dropper": "grpc", "node-1": "bulk", "node-2": "bulk",
                          "node-3": "bulk"}
    # The real nodes' training numbers came out as sums; the scripted site masked none, so
    # each sum says it covers three sites, and job status shows the last round's.
    assert {v["sites"] for v in rounds[4]["masked_metrics"].values()} == {3}
    status = federation.query("GetJob", job_id=doc["job_id"])
    last = status["masked_metrics"]
    assert last["round"] == 4 and last["loss"] == rounds[4]["train_loss"] > 0
    assert last["examples"] == rounds[4]["num_examples"] > 0


def test_below_threshold_the_round_fails_by_name_and_is_retried(
        federation: Federation, digits_split: list[Path]) -> None:
    # Two sites, threshold 2: the scripted one leaves after advertising its keys in the first
    # attempt, so share-keys ends with one site; the second attempt has both.
    job = write_job(federation.tmp / "job.toml", rounds=1, min_nodes=2, evaluate=False,
                    round_deadline_s=60, secure_aggregation={"stage_timeout_s": 3})
    federation.start_server(job, "--state-dir", str(federation.tmp / "state"),
                            "--heartbeat-s", "1")
    federation.start_node("node-1", digits_split[0], "--gpu", "none")
    stop, errors = threading.Event(), []
    thread = threading.Thread(target=_dropper, args=(
        federation.address, federation.token, federation.tmp, stop, errors,
        {(1, 1): Stage.SHARE_KEYS}))
    thread.start()
    try:
        status = federation.wait_state(("finished", "failed"), timeout=300)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not errors, errors
    assert status["state"] == "finished", status
    attempts = [r for r in federation.query("ListRounds")["rounds"] if r["round"] == 1]
    assert [r["status"] for r in attempts] == ["retried", "finished"]
    failed = attempts[0]["secure_aggregation"]["failed"]
    assert failed["stage"] == "share-keys"
    assert "1 sites left, threshold 2" in failed["reason"]
    assert "secure aggregation failed at share-keys" in attempts[0]["error"]
    assert attempts[1]["secure_aggregation"]["masked"] == 2


def _tls_flags(t: TlsFiles) -> list[str]:
    return ["--tls-cert", str(t.cert), "--tls-key", str(t.key), "--tls-ca", str(t.ca)]


def test_secure_round_under_mutual_tls_over_the_bulk_port(
        federation: Federation, digits_split: list[Path]) -> None:
    pki = federation.tmp / "pki"
    certs.init_ca(pki)
    server = certs.issue_server(pki)
    op = certs.issue_operator(pki)
    federation.tls = TlsFiles(op.cert, op.key, op.ca)
    job = write_job(federation.tmp / "job.toml", rounds=1, min_nodes=2, evaluate=False,
                    round_deadline_s=120, secure_aggregation={"stage_timeout_s": 20})
    federation.start_server(job, "--bulk-port", str(free_port()), "--heartbeat-s", "1",
                            *_tls_flags(TlsFiles(server.cert, server.key, server.ca)))
    for name, data in zip(("node-a", "node-b"), digits_split, strict=False):
        issued = certs.issue_node(pki, name)
        federation.start_node(name, data, "--gpu", "none",
                              *_tls_flags(TlsFiles(issued.cert, issued.key, issued.ca)))
    status = federation.wait_state(("finished", "failed"), timeout=300)
    assert status["state"] == "finished", status
    (rnd,) = [r for r in federation.query("ListRounds")["rounds"] if r["round"] == 1]
    assert rnd["secure_aggregation"]["masked"] == 2
    # The nodes have identities: they signed their keys and their survivor sets (the round
    # holds against an aggregator that bends the protocol, tests/unit/test_secagg_signed.py).
    assert rnd["secure_aggregation"]["signed"] is True
    assert {u["transport"] for u in rnd["updates"]} == {"bulk"}


def test_fedgpu_sim_speaks_the_protocol(federation: Federation) -> None:
    # 20 simulated sites in one process, 10 sampled per round, SecAgg+ with 4 neighbours and
    # FedAdam on top: the server optimiser sees the unmasked mean like any other.
    tmp = federation.tmp
    job = write_job(tmp / "job.toml", task="synthetic", hyperparameters={}, rounds=3,
                    min_nodes=10, min_available_nodes=20, fraction=0.5, evaluate=False,
                    strategy="fedadam", secure_aggregation={"neighbours": 4,
                                                            "stage_timeout_s": 20})
    server = federation.start_server(job, "--heartbeat-s", "2", "--bulk-port",
                                     str(free_port()))
    stats = tmp / "sim.json"
    sim = federation.spawn("sim", ["sim", "--aggregator", federation.address, "--nodes", "20",
                                   "--params", "20000", "--tensors", "5", "--poll-s", "5",
                                   "--stats", str(stats)])
    status = federation.wait_state(("finished", "failed"), timeout=240)
    rounds = federation.query("ListRounds")["rounds"]
    sim.popen.send_signal(signal.SIGTERM)
    assert sim.popen.wait(timeout=60) == 0, sim.text()[-3000:]
    server.popen.send_signal(signal.SIGTERM)
    assert status["state"] == "finished", status
    assert not json.loads(stats.read_text())["errors"]
    assert [r["status"] for r in rounds] == ["finished"] * 3
    for r in rounds:
        sa = r["secure_aggregation"]
        assert (sa["sites"], sa["masked"], sa["neighbours"]) == (10, 10, 4)
        assert sa["threshold"] == 3  # more than half of 5 shareholders
