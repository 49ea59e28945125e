"""Faults on real processes: kill -9 and restart the aggregator, kill -9 a node, training
subprocesses that run out of memory or crash, SIGTERM to either side, a foreign state dir."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core.job import load_job
from fedgpu.server.rounds.checkpoint import Checkpointer
from tests.fixtures import fault_tasks
from tests.fixtures.federation import ROOT, Federation, base_env, free_port, write_job

pytestmark = pytest.mark.timeout(240)


def faulty_env(tmp: Path, name: str, script: str = "") -> dict[str, str]:
    """A node environment where task `faulty` exists through a real entry point."""
    tasks = fault_tasks.install(tmp / "tasks")
    path = tmp / f"{name}.script"
    path.write_text(script)
    return base_env(FEDGPU_TOKEN="test-token", PYTHONPATH=f"{tasks}{os.pathsep}{ROOT}",
                    FEDGPU_TEST_SCRIPT=str(path),
                    FEDGPU_TEST_PIDFILE=str(tmp / f"{name}.worker.pid"))


def wait_for(what: str, check: Callable[[], object], timeout: float = 60,
             fed: Federation | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.2)
    logs = "" if fed is None else "\n".join(
        f"--- {p.name}\n{p.text()[-1500:]}" for p in fed.procs)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a dead parent's init) is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_aggregator_killed_mid_round_resumes(federation: Federation, tmp_path: Path,
                                             digits_split: list[Path]) -> None:
    state = tmp_path / "state"
    job = write_job(tmp_path / "job.toml", task="faulty", rounds=3, min_nodes=2,
                    round_deadline_s=60)
    port = free_port()
    args = ("--heartbeat-s", "1", "--state-dir", str(state))
    first = federation.start_server(job, *args, port=port)
    # Rounds of forked workers take a tenth of a second: each trains for a while first, so the
    # test sees round 2 open (the digits task it trains is unchanged).
    nodes = [federation.start_node(n, d, "--gpu", "none",
                                   env={**faulty_env(tmp_path, n),
                                        fault_tasks.SLEEP_ENV: "1.5"})
             for n, d in (("node-a", digits_split[0]), ("node-b", digits_split[1]))]

    def in_round_2() -> bool:
        cur = federation.query("GetStatus")["current_round"]
        return bool(cur and cur["round"] == 2 and cur["kind"] == "train")

    wait_for("round 2 to open", in_round_2, 120, federation)
    status = federation.query("GetStatus")
    run_id = status["run_id"]
    job_dir = state / "jobs" / status["job_id"]
    assert json.loads((job_dir / "state.json").read_text())["global_round"] == 1
    first.popen.kill()  # SIGKILL: no chance to write anything more
    first.popen.wait()
    federation.procs.remove(first)
    restarted_at = time.time()
    second = federation.spawn("aggregator-2", ["server", "start", "--job", str(job), "--host",
                                               "127.0.0.1", "--port", str(port), *args])
    federation.wait_healthy(second)
    assert f"resumed run {run_id} after round 1 of 3" in second.text()
    status = federation.wait_state(("finished", "failed"), timeout=180)
    assert status["state"] == "finished" and status["run_id"] == run_id
    rounds = federation.query("ListRounds")["rounds"]
    # Round 1 from before the crash, 2 (interrupted, so run again) and 3 after: each once.
    assert [(r["round"], r["status"]) for r in rounds] == [
        (1, "finished"), (2, "finished"), (3, "finished")]
    assert rounds[0]["started_at"] < restarted_at < rounds[1]["started_at"]
    assert all(r["nodes_reporting"] == 2 for r in rounds)
    # Both nodes found the new aggregator on their own and finished the run with it; they
    # stay up for the next job (the job was queued once: the restart did not queue it again).
    listed = federation.query("ListNodes")["nodes"]
    assert sorted(n["name"] for n in listed) == ["node-a", "node-b"]
    assert all(n["rounds_completed"] == 2 for n in listed)
    assert len(federation.query("ListJobs")) == 1
    for node in nodes:
        assert node.popen.poll() is None, node.text()[-2000:]
        assert "registering again" in node.text() or node.text().count("registered with") >= 2


def test_node_killed_mid_round_round_closes_at_deadline(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    # A deadline node-a meets even on a loaded machine (its round is one quick epoch), so the
    # round's outcome depends on node-b's death alone, not on how busy the cores are.
    deadline_s = 40
    job = write_job(tmp_path / "job.toml", task="faulty", rounds=2, min_nodes=1,
                    round_deadline_s=deadline_s, evaluate=False)
    federation.start_server(job, "--heartbeat-s", "1")
    federation.start_node("node-a", digits_split[0], env=faulty_env(tmp_path, "node-a"))
    victim = federation.start_node("node-b", digits_split[1],
                                   env=faulty_env(tmp_path, "node-b", "sleep 300\n"))
    pid_file = tmp_path / "node-b.worker.pid"
    wait_for("node-b to start training", pid_file.exists, 120, federation)
    wait_for("node-a's update", lambda: (federation.query("GetStatus")["current_round"] or {})
             .get("accepted") == 1, 120, federation)
    victim.popen.kill()
    victim.popen.wait()
    # Its training child ends on its own: the kernel tells it its agent died.
    wait_for("node-b's orphaned training child to end",
             lambda: not pid_alive(int(pid_file.read_text())), 10)
    status = federation.wait_state(("finished", "failed"), timeout=240)
    assert status["state"] == "finished", status
    rounds = federation.query("ListRounds")["rounds"]
    first = rounds[0]
    assert (first["round"], first["attempt"]) == (1, 1), rounds
    assert first["status"] == "finished" and first["nodes_reporting"] == 1
    assert len(first["dropped"]) == 1 and first["dropped"][0].startswith("node-b-")
    # Closed by the deadline (node-b never answered), not before; "after" has a wide margin.
    assert deadline_s <= first["duration_s"] < deadline_s + 60


def test_oom_and_crash_in_training_are_reported_and_node_keeps_serving(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    job = write_job(tmp_path / "job.toml", task="faulty", rounds=1, min_nodes=1,
                    round_deadline_s=60, evaluate=False, round_retries=3)
    federation.start_server(job, "--heartbeat-s", "1")
    node = federation.start_node("node-a", digits_split[0],
                                 env=faulty_env(tmp_path, "node-a", "oom\nexit\n"))
    assert federation.wait_state(("finished", "failed"))["state"] == "finished"
    rounds = federation.query("ListRounds")["rounds"]
    assert [r["status"] for r in rounds] == ["retried", "retried", "finished"]
    oom, crash = rounds[0]["failures"][0]["error"], rounds[1]["failures"][0]["error"]
    assert oom.startswith("CUDA out of memory (CUDA out of memory. Tried to allocate 20.00 GiB")
    assert "lower 'batch_size'" in oom
    assert crash == "training subprocess exited with code 7"
    (me,) = federation.query("ListNodes")["nodes"]
    assert (me["rounds_failed"], me["rounds_completed"]) == (2, 1)
    assert node.popen.poll() is None, node.text()[-2000:]  # serving, for the next job


def test_sigterm_stops_node_child_and_aggregator_cleanly(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    state = tmp_path / "state"
    job = write_job(tmp_path / "job.toml", task="faulty", rounds=2, min_nodes=1,
                    round_deadline_s=120, evaluate=False)
    server = federation.start_server(job, "--heartbeat-s", "1", "--state-dir", str(state))
    node = federation.start_node("node-a", digits_split[0],
                                 env=faulty_env(tmp_path, "node-a", "sleep 120\n"))
    pid_file = tmp_path / "node-a.worker.pid"
    wait_for("training to start", pid_file.exists, 60, federation)
    child = int(pid_file.read_text())
    job_id = federation.query("GetStatus")["job_id"]
    node.popen.send_signal(signal.SIGTERM)
    assert node.popen.wait(timeout=15) == 0, node.text()[-2000:]
    wait_for("the training child to be gone", lambda: not pid_alive(child), 10)
    assert "SIGTERM: stopped" in node.text()

    server.popen.send_signal(signal.SIGTERM)
    assert server.popen.wait(timeout=15) == 0, server.text()[-2000:]
    assert "stopped cleanly" in server.text()
    saved = Checkpointer(state / "jobs" / job_id).load()
    assert saved is not None and saved[1]["global_round"] == 0  # the starting model


def test_a_jobs_checkpoint_of_another_job_fails_that_job_only(
        federation: Federation, tmp_path: Path) -> None:
    # Restarted on a state directory whose running job's checkpoint holds another model (a
    # directory edited by hand), the aggregator fails that job with the mismatch named and
    # keeps serving the queue.
    state = tmp_path / "state"
    job = write_job(tmp_path / "b.toml", task="faulty", rounds=1, min_nodes=1)
    federation.start_server(job, "--state-dir", str(state))
    (row,) = federation.query("ListJobs")
    federation.stop()
    federation.procs.clear()
    done = load_job(write_job(tmp_path / "a.toml", task="digits", rounds=1, min_nodes=1))
    Checkpointer(state / "jobs" / row["job_id"]).save(
        {"w": np.zeros(2, np.float32)},
        {"run_id": "abc", "global_round": 1, "job": done.to_dict(), "history": []})
    federation.restart_server()
    end = time.monotonic() + 60
    while federation.query("GetJob", job_id=row["job_id"])["state"] != "failed":
        assert time.monotonic() < end, federation.query("ListJobs")
        time.sleep(0.3)
    error = federation.query("GetJob", job_id=row["job_id"])["error"]
    assert "holds run abc with task = 'digits', but this job has task = 'faulty'" in error
