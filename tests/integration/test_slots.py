"""Per-site slots with real processes on loopback: one site serving two studies, an aggregator
with --max-concurrent-jobs 2. With `fedgpu node start --slots 2` the jobs of both studies train
on that site at the same time (the node's round workers overlap: shown from the round records,
each round's worker time ending where its update arrived), and stopping one leaves the other's
rounds untouched; with `--slots 1` the second job waits, and its reason names the busy slot.

Threat model: none beyond correctness and isolation: a site's tasks of two jobs must each reach
its own job (no update of one job lands in the other's round, no task is run twice), and a
job's stop must not cost the other job a round. Each job samples only its own study's sites.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fedgpu.core import admin_client
from tests.fixtures.federation import Federation, write_job
from tests.integration.test_jobs import wait_job

# Every round trains for this long on the site (local_work = "time"): long enough that two
# rounds run one after the other could not overlap by half of it (the update's upload after
# its worker ended is a fraction of a second on loopback).
TRAIN_S = 2.0


def _federation(fed: Federation, tmp_path: Path, data: Path, slots: int) -> None:
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1",
                     "--max-concurrent-jobs", "2")
    fed.start_node("site-a", data, "--gpu", "none", "--slots", str(slots))
    for study in ("onco", "cardio"):
        fed.query("CreateStudy", name=study)
        fed.query("EnrolSites", name=study, sites=["site-a"])


def _submit(fed: Federation, tmp_path: Path, study: str, rounds: int) -> str:
    path = write_job(tmp_path / f"{study}.toml", study=study, min_nodes=1, rounds=rounds,
                     round_deadline_s=60, evaluate=False, local_work="time",
                     round_train_s=TRAIN_S)
    doc = admin_client.submit_job(fed.address, fed.operator_token, path.read_text(), path.name)
    return str(doc["job_id"])


def _worker_spans(rounds: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """When the site's round worker of each finished training round ran, at the latest: it
    ended before its update arrived (the round's end, one site per round) and ran for its
    reported round_seconds."""
    spans = []
    for r in rounds:
        if r["status"] != "finished" or not r["updates"] or r["round"] < 1:
            continue
        end = r["started_at"] + r["duration_s"]
        spans.append((end - r["updates"][0]["resources"]["round_seconds"], end))
    return spans


def _longest_overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return max((min(x1, y1) - max(x0, y0) for x0, x1 in a for y0, y1 in b), default=0.0)


def test_two_slots_run_two_jobs_on_one_site_at_once_and_a_stop_spares_the_other(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    _federation(fed, tmp_path, digits_split[0], slots=2)
    long = _submit(fed, tmp_path, "onco", rounds=200)
    short = _submit(fed, tmp_path, "cardio", rounds=2)
    done = wait_job(fed, short, ("finished", "failed"), timeout=180)
    assert done["state"] == "finished", done
    (node,) = fed.query("ListNodes")["nodes"]
    assert node["slots"] == 2  # as it advertised at registration
    # Both ran side by side: the long job is still running, and the site's workers of the
    # two jobs ran at the same time for most of a round.
    assert fed.query("GetJob", job_id=long)["state"] == "running"
    long_rounds = fed.query("ListRounds", job_id=long)["rounds"]
    short_rounds = fed.query("ListRounds", job_id=short)["rounds"]
    overlap = _longest_overlap(_worker_spans(long_rounds), _worker_spans(short_rounds))
    assert overlap > TRAIN_S / 2, (long_rounds, short_rounds)
    # Each job's updates came from the site, each job's rounds in one attempt.
    assert [(r["round"], r["attempt"], r["status"]) for r in short_rounds] == [
        (1, 1, "finished"), (2, 1, "finished")]
    assert all(r["attempt"] == 1 for r in long_rounds), long_rounds

    # A third job (of the short job's study) takes the freed slot; stopping the long job
    # leaves its rounds untouched.
    again = _submit(fed, tmp_path, "cardio", rounds=1)
    wait_job(fed, again, ("running",), timeout=60)
    fed.query("StopJob", job_id=long)
    assert wait_job(fed, long, ("stopped",), timeout=60)["state"] == "stopped"
    done = wait_job(fed, again, ("finished", "failed"), timeout=180)
    assert done["state"] == "finished", done
    rounds = fed.query("ListRounds", job_id=again)["rounds"]
    assert [(r["attempt"], r["status"]) for r in rounds] == [(1, "finished")], rounds


def test_one_slot_makes_the_second_job_wait_and_name_the_busy_slot(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    _federation(fed, tmp_path, digits_split[0], slots=1)
    long = _submit(fed, tmp_path, "onco", rounds=200)
    # Once the site trains the long job's first task, its one slot is the long job's.
    end = time.monotonic() + 90
    while time.monotonic() < end:
        if [n["state"] for n in fed.query("ListNodes")["nodes"]] == ["training"]:
            break
        time.sleep(0.1)
    waiting = _submit(fed, tmp_path, "cardio", rounds=1)
    expected = (f"needs 1 sites of study cardio; 1 busy with job {long} "
                "(site-a: 1 of 1 slot)")
    doc: dict[str, Any] = {}
    end = time.monotonic() + 90
    while time.monotonic() < end:  # the queue looks again every second
        doc = fed.query("GetJob", job_id=waiting)
        if doc.get("reason") == expected:
            break
        time.sleep(0.1)
    assert doc["state"] == "queued" and doc["reason"] == expected, doc
    fed.query("StopJob", job_id=waiting)
    fed.query("StopJob", job_id=long)
