"""A federation that stays up (issue 14's walk-through, with real processes on loopback):
an aggregator started without a job, two nodes, jobs submitted, queued, run one after the
other on the same node processes, the aggregator SIGKILLed and restarted mid-job, models
downloaded, a bad job file refused, a running job stopped."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.federation import (
    OPERATOR_TOKEN,
    Federation,
    cli,
    write_job,
)

DIGITS_TENSORS = {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight",
                  "fc1.bias", "fc2.weight", "fc2.bias"}


def job_cli(fed: Federation, *args: str, token: str = OPERATOR_TOKEN,
            timeout: float = 120) -> Any:
    r = cli("job", *args, "--address", fed.address, "--json", operator_token=token,
            timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_job(fed: Federation, job_id: str, states: tuple[str, ...], timeout: float = 300
             ) -> dict[str, Any]:
    # Asked in-process (the same Admin call `fedgpu job status` makes), several times a
    # second: a round through the worker factory can take a fraction of a second.
    end = time.monotonic() + timeout
    doc: dict[str, Any] = {}
    while time.monotonic() < end:
        doc = fed.query("GetJob", job_id=job_id)
        if doc["state"] in states:
            return doc
        time.sleep(0.1)
    logs = "\n".join(f"--- {p.name}\n{p.text()[-2000:]}" for p in fed.procs)
    raise AssertionError(f"job {job_id} is {doc.get('state')}, never {states}\n{logs}")


@pytest.fixture
def stays_up(federation: Federation, tmp_path: Path, digits_split: list[Path]
             ) -> Federation:
    state = tmp_path / "state"
    federation.start_server(None, "--state-dir", str(state), "--heartbeat-s", "1")
    federation.start_node("site-a", digits_split[0], "--gpu", "none")
    federation.start_node("site-b", digits_split[1], "--gpu", "none")
    return federation


def test_jobs_queue_run_in_order_survive_sigkill_and_download(
        stays_up: Federation, tmp_path: Path) -> None:
    fed = stays_up
    job1 = write_job(tmp_path / "job1.toml", rounds=3, name="first")
    # Long enough to be killed in the middle of, however fast its rounds are.
    job2 = write_job(tmp_path / "job2.toml", rounds=40, name="second",
                     hyperparameters={"lr": 0.05, "local_epochs": 2})

    # A node's credential may not submit: nothing is queued.
    r = cli("job", "submit", str(job1), "--address", fed.address, "--json",
            operator_token=fed.token)
    assert r.returncode != 0 and "operator credential" in r.stderr, r.stderr
    assert job_cli(fed, "list") == []

    first = job_cli(fed, "submit", str(job1))
    assert first["state"] == "queued" and first["job_id"]
    # No site has trained digits yet: nothing to estimate from.
    assert first["estimate"] is None
    second = job_cli(fed, "submit", str(job2))
    listed = job_cli(fed, "list")
    assert [j["job_id"] for j in listed] == [first["job_id"], second["job_id"]]
    assert listed[1]["state"] == "queued"

    done = wait_job(fed, first["job_id"], ("finished", "failed", "stopped"))
    assert done["state"] == "finished", done
    assert done["rounds_done"] == 3 and done["accuracy"] >= 0.8, done
    pids = {p.name: p.popen.pid for p in fed.procs if p.name.startswith("site-")}

    # Now the sites' speed is known: a job that would train for hours says so at submit.
    huge = write_job(tmp_path / "huge.toml", rounds=20000, name="huge",
                     hyperparameters={"local_epochs": 50})
    r = cli("job", "submit", str(huge), "--address", fed.address, operator_token=OPERATOR_TOKEN)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("queued")
    assert "warning: training time: about " in r.stderr and " h" in r.stderr, r.stderr
    assert "examples/s" in r.stderr and "round_train_s" in r.stderr, r.stderr
    huge_id = r.stdout.split()[1]
    est = [e["message"] for e in job_cli(fed, "logs", huge_id) if "estimated" in e["message"]]
    assert est and "slowest site site-" in est[0], est
    assert job_cli(fed, "stop", huge_id)["state"] == "stopped"

    # The second job runs next, on the same node processes; kill the aggregator mid-job.
    wait_job(fed, second["job_id"], ("running",))
    rounds_before = 0
    end = time.monotonic() + 300
    while rounds_before < 1 and time.monotonic() < end:
        rounds_before = fed.query("GetJob", job_id=second["job_id"])["rounds_done"]
        time.sleep(0.05)
    assert 1 <= rounds_before < 40
    server = next(p for p in fed.procs if p.name == "aggregator")
    os.kill(server.popen.pid, signal.SIGKILL)
    server.popen.wait(timeout=30)
    fed.restart_server()

    resumed = wait_job(fed, second["job_id"], ("finished", "failed", "stopped"))
    assert resumed["state"] == "finished", resumed
    assert resumed["rounds_done"] == 40
    events = job_cli(fed, "logs", second["job_id"])
    assert any("resumed after round" in e["message"] for e in events), events
    # Each round's line says what a person watches for (`job logs --follow` prints it).
    closed = [e["message"] for e in events if " closed: " in e["message"]]
    assert any(m.startswith("round 40 closed: ") and "train loss" in m for m in closed), closed
    assert any("model of round" in m and "accuracy" in m for m in closed), closed
    assert {p.name: p.popen.pid for p in fed.procs if p.name.startswith("site-")} == pids
    assert all(p.popen.poll() is None for p in fed.procs if p.name.startswith("site-"))

    listed = job_cli(fed, "list")
    assert [j["state"] for j in listed] == ["finished", "finished", "stopped"]
    model = tmp_path / "m.safetensors"
    got = job_cli(fed, "model", first["job_id"], "-o", str(model))
    assert got["round"] == 3 and model.stat().st_size == got["size"]
    from safetensors.numpy import load_file

    assert set(load_file(str(model))) == DIGITS_TENSORS
    rounds = json.loads(cli("rounds", "--address", fed.address, "--job", first["job_id"],
                            "--json").stdout)
    assert [r["round"] for r in rounds["rounds"] if r["status"] == "finished"] == [1, 2, 3]


def test_a_bad_job_file_is_refused_and_nothing_is_queued(federation: Federation,
                                                         tmp_path: Path) -> None:
    # Refused at submission: the aggregator alone decides (nodes would only add start-up time).
    fed = federation
    fed.start_server(None, "--state-dir", str(tmp_path / "state"))
    bad = write_job(tmp_path / "bad.toml", roundz=3)
    r = cli("job", "submit", str(bad), "--address", fed.address)
    assert r.returncode != 0 and "roundz" in r.stderr, r.stderr
    big = tmp_path / "big.toml"
    big.write_text('task = "digits"\n' + "# padding\n" * 40_000)
    r = cli("job", "submit", str(big), "--address", fed.address)
    assert r.returncode != 0 and "limit" in r.stderr, r.stderr
    r = cli("job", "status", "nope", "--address", fed.address)
    assert r.returncode != 0 and "no job 'nope'" in r.stderr, r.stderr
    assert job_cli(fed, "list") == []


def test_a_job_needing_more_sites_than_registered_is_queued_with_a_warning(
        stays_up: Federation, tmp_path: Path) -> None:
    fed = stays_up
    job = write_job(tmp_path / "wide.toml", rounds=1, min_nodes=50)
    r = cli("job", "submit", str(job), "--address", fed.address, "--json",
            operator_token=OPERATOR_TOKEN)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # stdout stays the one document
    assert "warning: min_nodes = 50, but" in r.stderr and "site(s) are registered" in r.stderr
    assert doc["state"] == "queued" and "min_nodes = 50" in doc["warnings"][0]
    assert job_cli(fed, "stop", doc["job_id"])["state"] == "stopped"


def test_stop_ends_a_running_job_within_a_round_deadline(stays_up: Federation,
                                                         tmp_path: Path) -> None:
    fed = stays_up
    job = write_job(tmp_path / "long.toml", rounds=50, round_deadline_s=60,
                    hyperparameters={"lr": 0.05, "local_epochs": 3})
    queued = write_job(tmp_path / "next.toml", rounds=1)
    running = job_cli(fed, "submit", str(job))
    later = job_cli(fed, "submit", str(queued))
    wait_job(fed, running["job_id"], ("running",))
    t0 = time.monotonic()
    assert job_cli(fed, "stop", running["job_id"])["job_id"] == running["job_id"]
    stopped = wait_job(fed, running["job_id"], ("stopped", "finished", "failed"), timeout=60)
    assert stopped["state"] == "stopped" and time.monotonic() - t0 < 60
    # The queue goes on: the next job runs on the same nodes.
    assert wait_job(fed, later["job_id"], ("finished", "failed"))["state"] == "finished"


def test_a_node_without_the_task_is_left_out_with_the_reason(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    # Queued at start (`job submit` would refuse a task no registered node offers: below).
    job = write_job(tmp_path / "other.toml", task="no-such-task", min_nodes=1)
    fed.start_server(job, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1")
    fed.start_node("site-a", digits_split[0], "--gpu", "none")
    (submitted,) = fed.query("ListJobs")
    doc = wait_job(fed, submitted["job_id"], ("waiting",), timeout=120)
    # The job may wait before the node has registered: then it lists no node yet.
    end = time.monotonic() + 120
    while not doc["nodes"] and time.monotonic() < end:
        time.sleep(0.2)
        doc = wait_job(fed, submitted["job_id"], ("waiting",), timeout=120)
    assert "1 nodes it needs" in doc["reason"] or "of the 1" in doc["reason"], doc
    (part,) = doc["nodes"]
    assert part["name"] == "site-a" and part["eligible"] is False
    assert "no-such-task" in part["reason"] and "not installed" in part["reason"]
    # Once a node is registered, `job submit` refuses a typo at once, with what it resembles.
    typo = write_job(tmp_path / "typo.toml", task="digitz", min_nodes=1)
    r = cli("job", "submit", str(typo), "--address", fed.address, operator_token=OPERATOR_TOKEN)
    assert r.returncode != 0 and "did you mean 'digits'" in r.stderr, r.stderr
    assert [j["job_id"] for j in fed.query("ListJobs")] == [submitted["job_id"]]
