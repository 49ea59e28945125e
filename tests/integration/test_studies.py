"""Studies with real processes on loopback: an admin creates a study and enrols one of two
connected sites; a job of that study trains on that site only, while `job status` says why the
other takes no part; names that are not studies are refused once studies exist; the changes
are on the audit log.

Threat model: a job must not reach a site outside its study (a hospital enrolled in one study
trains only its jobs), whatever its min_nodes or fraction asks; a mistyped study must not run
a job everywhere. Not covered: an admin enrolling a site on purpose (the site's own policy
answers that, server/studies.py site_refuses_study).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedgpu.core import admin_client, audit
from fedgpu.core.errors import FedgpuError
from tests.fixtures.federation import Federation, cli, write_job
from tests.integration.test_jobs import wait_job

# The CLI is run for one command of each kind (a process costs seconds on a loaded machine);
# the rest ask the aggregator in-process, with the same Admin calls.


def _fedgpu(fed: Federation, *args: str) -> dict:  # type: ignore[type-arg]
    done = cli(*args, "--address", fed.address, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _submit(fed: Federation, path: Path) -> dict:  # type: ignore[type-arg]
    return admin_client.submit_job(fed.address, fed.operator_token, path.read_text(),
                                   path.name)


def test_a_study_job_trains_on_its_enrolled_sites_only(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    state = tmp_path / "state"
    fed.start_server(None, "--state-dir", str(state), "--heartbeat-s", "1")
    fed.start_node("site-a", digits_split[0], "--gpu", "none")
    fed.start_node("site-b", digits_split[1], "--gpu", "none")
    created = _fedgpu(fed, "studies", "create", "onco")
    assert created["study"]["name"] == "onco" and created["study"]["sites"] == []
    enrolled = fed.query("EnrolSites", name="onco", sites=["site-a"])
    assert enrolled["study"]["sites"] == ["site-a"]
    # A researcher's study and a job's study must be studies now.
    with pytest.raises(FedgpuError, match="no study 'oncology'"):
        fed.query("AddUser", name="rob", role="researcher", studies=["oncology"])
    typo = write_job(tmp_path / "typo.toml", study="oncology", min_nodes=1, rounds=1)
    with pytest.raises(FedgpuError, match="no study 'oncology'"):
        _submit(fed, typo)
    assert fed.query("ListJobs") == []

    # fraction 1.0 with both sites connected: only the study's one is sampled.
    job = write_job(tmp_path / "onco.toml", study="onco", min_nodes=1, rounds=2,
                    round_deadline_s=60)
    submitted = _submit(fed, job)
    doc = wait_job(fed, submitted["job_id"], ("finished", "failed"), timeout=240)
    assert doc["state"] == "finished", doc
    rounds = fed.query("ListRounds", job_id=submitted["job_id"])["rounds"]
    assert len(rounds) == 2
    assert {u["node"] for r in rounds for u in r["updates"]} == {"site-a"}

    # A second job of the study, after site-a is withdrawn: it waits, and says why.
    fed.query("WithdrawSites", name="onco", sites=["site-a"])
    waiting = _submit(fed, job)
    doc = wait_job(fed, waiting["job_id"], ("waiting",), timeout=60)
    assert "0 of the 1" in doc["reason"] and "not enrolled in study 'onco'" in doc["reason"]
    parts = {p["name"]: p for p in doc["nodes"]}
    assert parts["site-b"]["reason"] == "not enrolled in study 'onco'"
    listed = fed.query("ListStudies")["studies"]
    assert [(s["name"], s["sites"]) for s in listed] == [("onco", [])]
    shown = cli("studies", "list", "--address", fed.address)
    assert shown.returncode == 0 and "onco" in shown.stdout and "0/0" in shown.stdout, shown
    fed.query("StopJob", job_id=waiting["job_id"])

    # Every change is on the aggregator's audit log, with the study and the sites.
    records = [r for r in audit.read(state / audit.AUDIT_FILE)
               if r["action"] in ("Admin.CreateStudy", "Admin.EnrolSites",
                                  "Admin.WithdrawSites")]
    assert [(r["action"], r["target"], r["outcome"]) for r in records] == [
        ("Admin.CreateStudy", "onco", "OK"), ("Admin.EnrolSites", "onco", "OK"),
        ("Admin.WithdrawSites", "onco", "OK")]
    assert "site-a" in records[1]["detail"]


def test_two_studies_jobs_run_at_once_and_ending_one_leaves_the_other(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    """--max-concurrent-jobs 2, two studies on disjoint sites: jobs of both run at the same
    time; one that fails, and one that is stopped, leave the other's rounds untouched; a job
    of a busy study stays queued saying which job holds its site, and takes it once freed."""
    fed = federation
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1",
                     "--max-concurrent-jobs", "2")
    fed.start_node("site-a", digits_split[0], "--gpu", "none")
    fed.start_node("site-b", digits_split[1], "--gpu", "none")
    for study, site in (("onco", "site-a"), ("cardio", "site-b")):
        fed.query("CreateStudy", name=study)
        fed.query("EnrolSites", name=study, sites=[site])

    def submit(name: str, study: str, **keys: object) -> str:
        path = write_job(tmp_path / f"{name}.toml", **{"study": study, "min_nodes": 1,
                                                        "round_deadline_s": 60, **keys})
        return str(_submit(fed, path)["job_id"])

    long = submit("long", "onco", rounds=500)
    # Fails early: the site's update claims more examples than it may (or, on a loaded
    # machine, its initial model misses the short deadline); either way it fails mid-run.
    failing = submit("failing", "cardio", rounds=3, max_examples_per_node=1, round_retries=0,
                     round_deadline_s=10)
    after = submit("after", "onco", rounds=1)
    wait_job(fed, long, ("running",), timeout=120)
    failed = wait_job(fed, failing, ("failed",), timeout=120)
    assert failed["error"], failed
    queued = fed.query("GetJob", job_id=after)
    assert queued["state"] == "queued", queued
    assert queued["reason"] == (f"needs 1 sites of study onco; 1 busy with job {long} "
                                "(site-a: 1 of 1 slot)")
    listed = {j["job_id"]: j for j in fed.query("ListJobs")}
    assert listed[after]["reason"] == queued["reason"]

    # The freed site takes the next job of its study, beside the long one.
    short = submit("short", "cardio", rounds=3)
    done = wait_job(fed, short, ("finished", "failed"), timeout=180)
    assert done["state"] == "finished", done
    assert fed.query("GetJob", job_id=long)["state"] == "running"  # still going, alongside
    fed.query("StopJob", job_id=long)
    rounds = fed.query("ListRounds", job_id=short)["rounds"]
    assert [(r["round"], r["attempt"], r["status"]) for r in rounds] == [
        (1, 1, "finished"), (2, 1, "finished"), (3, 1, "finished")]
    assert {u["node"] for r in rounds for u in r["updates"]} == {"site-b"}
    # The long job's rounds went on through the other job's failure: none was retried.
    long_rounds = fed.query("ListRounds", job_id=long)["rounds"]
    assert long_rounds and all(r["attempt"] == 1 for r in long_rounds), long_rounds
    # Its site, freed by the stop, takes the queued job of its study.
    assert wait_job(fed, after, ("finished", "failed"), timeout=180)["state"] == "finished"
    rounds = fed.query("ListRounds", job_id=after)["rounds"]
    assert {u["node"] for r in rounds for u in r["updates"]} == {"site-a"}
    assert fed.query("GetJob", job_id=long)["state"] == "stopped"
