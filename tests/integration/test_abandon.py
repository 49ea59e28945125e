"""`fedgpu job stop` reaches the nodes: a node training a task of the stopped job hears at its
next heartbeat that the task is no longer wanted, its round's worker is killed (the GPU it
held is freed at once, not at the end of a long round) and nothing is sent for the task; the
same agent then takes the next job."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.fixtures import fault_tasks
from tests.fixtures.federation import ROOT, Federation, base_env, write_job
from tests.integration.test_jobs import job_cli, wait_job


def running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_stop_kills_the_nodes_training_process_and_the_node_takes_the_next_job(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    tasks = fault_tasks.install(tmp_path / "tasks")
    pidfile = tmp_path / "worker.pid"
    # Every training call of the faulty task sleeps 10 minutes first: a long round.
    env = base_env(FEDGPU_TOKEN=fed.token, PYTHONPATH=f"{tasks}{os.pathsep}{ROOT}",
                   FEDGPU_TEST_TRAIN_SLEEP="600", FEDGPU_TEST_PIDFILE=str(pidfile))
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1")
    node = fed.start_node("site-a", digits_split[0], "--gpu", "none", env=env)
    long = write_job(tmp_path / "long.toml", task="faulty", rounds=3, min_nodes=1,
                     round_deadline_s=900)
    following = write_job(tmp_path / "next.toml", rounds=1, min_nodes=1)
    stopped = job_cli(fed, "submit", str(long))["job_id"]
    later = job_cli(fed, "submit", str(following))["job_id"]

    end = time.monotonic() + 240
    while not pidfile.exists() and time.monotonic() < end:
        time.sleep(0.2)
    assert pidfile.exists(), node.text()[-3000:]
    pid = int(pidfile.read_text())
    assert running(pid) and pid != node.popen.pid

    t0 = time.monotonic()
    job_cli(fed, "stop", stopped)
    while running(pid) and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    gone_s = time.monotonic() - t0
    assert not running(pid), "the stopped job's worker still trains"
    assert gone_s < 10, f"the worker outlived the stop by {gone_s:.1f}s"
    assert wait_job(fed, stopped, ("stopped", "finished", "failed"), 60)["state"] == "stopped"

    # The same agent process takes the next job and finishes it.
    assert wait_job(fed, later, ("finished", "failed"))["state"] == "finished"
    assert node.popen.poll() is None
    log = node.text()
    assert "abandoning it" in log and "abandoned" in log, log[-3000:]
    # Nothing was sent for the abandoned task: the stopped job refused no late update.
    status = fed.query("GetStatus", job_id=stopped)
    assert status["rejections"] == {}, status
