"""Stop means stopped (issue 36): a `job stop` that races the job's start either stops it or
answers its real state; the row and the engine never disagree, and the queue moves on.

Before, a stop that came while the queue was setting the job up (its weights read in a thread)
marked the row stopped, then the start wrote `running` over it and the engine opened its
rounds; every job behind it stayed queued for good. Here submit and stop are fired at a real
aggregator on loopback, from two threads at once, many times."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fedgpu.core import admin_client
from tests.fixtures.federation import OPERATOR_TOKEN, Federation

ROUNDS = 150
JOB = 'task = "digits"\nrounds = 1\nqueue_timeout_s = 3600\n'


def _submit_and_stop(fed: Federation, i: int) -> tuple[str, str]:
    doc = admin_client.submit_job(fed.address, OPERATOR_TOKEN, JOB, f"race-{i}.toml")
    answer = admin_client.query(fed.address, OPERATOR_TOKEN, "StopJob", job_id=doc["job_id"])
    return doc["job_id"], answer["state"]


def test_submit_and_stop_racing_never_leave_a_stopped_job_running(
        federation: Federation, tmp_path: Path) -> None:
    fed = federation
    # No nodes: a job that starts waits for them, so the only job that may be active at the
    # end is the last one, which nobody stopped.
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--max-queued-jobs", "500")
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda i: _submit_and_stop(fed, i), range(ROUNDS)))
    # A stop answers the real state: stopped, or running while the engine is being cancelled.
    assert {state for _, state in answers} <= {"stopped", "running", "waiting"}
    last = admin_client.submit_job(fed.address, OPERATOR_TOKEN, JOB, "last.toml")["job_id"]
    end = time.monotonic() + 60
    while True:
        jobs = {j["job_id"]: j for j in fed.query("ListJobs")}
        if jobs[last]["state"] in ("waiting", "running") or time.monotonic() > end:
            break
        time.sleep(0.2)
    # The queue moved on past every stopped job, to the last one.
    assert jobs[last]["state"] in ("waiting", "running"), jobs[last]
    for job_id, _ in answers:
        row = jobs[job_id]
        assert row["state"] == "stopped", row
        # Never started after it was stopped (the row said running with finished_at before
        # started_at).
        assert row["started_at"] is None or row["started_at"] <= row["finished_at"], row
    # The engine that answers is the last job's: no stopped job's engine runs on.
    assert fed.query("GetStatus")["job_id"] == last
