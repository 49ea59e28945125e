"""Site-owned policies with real processes on loopback: node agents started with `--policy`,
a real aggregator, `fedgpu job submit`'s question to it before queueing, and the site's own
refusal answered as "ineligible" and written to the site's hash-chained audit log.

Threat model (docs/explanation/security.md, "Site policies"): the site enforces; what the
aggregator knows of a policy is the copy the node advertised, used to sample and to warn at
submit (a courtesy). The second test shows the node refusing on a count only it keeps (its
GPU time per job), which no aggregator can see or change.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.fixtures.fake_nvml import FakeNvml, write_inventory
from tests.fixtures.federation import Federation, cli, write_job
from tests.integration.test_jobs import job_cli, wait_job

STRICT = """
tasks = ["digits"]
max_rounds = 2
require_secure_aggregation = true
max_epsilon = 8
"""


def wait_alive(fed: Federation, names: set[str], timeout: float = 60) -> list[dict[str, Any]]:
    end = time.monotonic() + timeout
    nodes: list[dict[str, Any]] = []
    while time.monotonic() < end:
        nodes = fed.query("ListNodes")["nodes"]
        if names <= {n["name"] for n in nodes if n["alive"]}:
            return nodes
        time.sleep(0.2)
    raise AssertionError(f"never alive: {names}: {nodes}")


def submit(fed: Federation, job: Path, *extra: str) -> Any:
    return cli("job", "submit", str(job), "--address", fed.address, "--json", *extra,
               timeout=120)


def test_submit_names_the_sites_that_would_refuse_and_the_aggregator_samples_by_policy(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1")
    (tmp_path / "strict.toml").write_text(STRICT)
    # A window that never holds now (the hours are not held against a job at submit).
    hour = time.gmtime().tm_hour
    (tmp_path / "night.toml").write_text(
        f'hours = "{(hour + 2) % 24:02d}:00-{(hour + 3) % 24:02d}:00"\n')
    fed.start_node("open", digits_split[0])
    # Sites that never train here start no worker factory (no torch import): cheaper.
    fed.start_node("strict", digits_split[1], "--policy", str(tmp_path / "strict.toml"),
                   "--no-prestart")
    fed.start_node("night", digits_split[1], "--policy", str(tmp_path / "night.toml"),
                   "--no-prestart")
    nodes = {n["name"]: n for n in wait_alive(fed, {"open", "strict", "night"})}
    # Each node advertised its policy; the aggregator lists it as the site wrote it.
    assert nodes["open"]["site_policy"] is None
    assert nodes["strict"]["site_policy"] == {
        "tasks": ["digits"], "max_rounds": 2, "require_secure_aggregation": True,
        "max_epsilon": 8.0}

    # Three sites are needed, two connected sites would take the job: nothing is queued, and
    # the refusing site's every reason is named.
    job = write_job(tmp_path / "job.toml", rounds=3, min_nodes=3)
    r = submit(fed, job)
    assert r.returncode == 1, r.stderr
    assert "not queued: 2 of 3 connected site(s) would accept this job" in r.stderr
    assert "site strict would refuse this job: the site requires secure_aggregation = true; " \
           "the site requires differential privacy ([privacy] with target_epsilon <= 8); " \
           "rounds = 3 is over the site's maximum 2 per job" in r.stderr, r.stderr
    assert "site night trains only" in r.stderr
    assert fed.query("ListJobs") == []

    # Enough sites would take it: queued, the refusals still said; --json carries them.
    small = write_job(tmp_path / "small.toml", rounds=1, min_nodes=1)
    r = submit(fed, small)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [s["node"] for s in doc["site_policies"]["refusing"]] == ["strict"]
    assert doc["site_policies"]["accepting"] == 2
    assert wait_job(fed, doc["job_id"], ("finished", "failed"))["state"] == "finished"
    (rnd,) = fed.query("ListRounds", job_id=doc["job_id"])["rounds"]
    # The site whose policy refuses is never sampled, nor the one outside its hours.
    assert {u["node"] for u in rnd["updates"]} == {"open"}

    # --queue-anyway queues what too few sites would take; `job status` says why it waits.
    r = submit(fed, job, "--queue-anyway")
    assert r.returncode == 0 and "queued anyway (--queue-anyway)" in r.stderr, r.stderr
    job_id = json.loads(r.stdout)["job_id"]
    end = time.monotonic() + 60
    parts: dict[str, Any] = {}
    while time.monotonic() < end:
        status = job_cli(fed, "status", job_id)
        parts = {p["name"]: p for p in status.get("nodes") or []}
        if "strict" in parts and "night" in parts:
            break
        time.sleep(0.3)
    assert parts["strict"]["reason"].startswith("site policy: the site requires secure"), parts
    assert parts["night"]["reason"].startswith("site policy: the site trains only"), parts
    job_cli(fed, "stop", job_id)


def test_the_site_refuses_on_its_own_count_and_its_audit_log_shows_it(
        fake_nvml: FakeNvml, federation: Federation, tmp_path: Path,
        digits_split: list[Path]) -> None:
    fed = federation
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1")
    inventory = tmp_path / "gpu.conf"
    write_inventory(inventory, [{"memory_total_mib": 16000, "memory_used_mib": 1000}])
    env = fake_nvml.env({"FEDGPU_SIMULATED_GPUS": "1", "FEDGPU_TOKEN": fed.token,
                         "PYTHONUNBUFFERED": "1"})
    env["FAKE_NVML_CONFIG"] = str(inventory)
    # A budget of 3.6 ms of GPU time per job: the first task on the (simulated) GPU spends it.
    (tmp_path / "site.toml").write_text("max_gpu_hours = 0.000001\n")
    state = tmp_path / "site-state"
    node = fed.start_node("gpu-site", digits_split[0], "--gpu", "offer", "--policy",
                          str(tmp_path / "site.toml"), "--state-dir", str(state), env=env)
    wait_alive(fed, {"gpu-site"})
    job = write_job(tmp_path / "job.toml", rounds=3, min_nodes=1, use_gpu=True)
    job_id = job_cli(fed, "submit", str(job))["job_id"]

    end = time.monotonic() + 120
    refusals: list[dict[str, Any]] = []
    while time.monotonic() < end and not refusals:
        rounds = fed.query("ListRounds", job_id=job_id)["rounds"]
        refusals = [i for r in rounds for i in r.get("ineligible") or []]
        time.sleep(0.3)
    job_cli(fed, "stop", job_id)
    # The aggregator's copy of the policy has nothing against the job: the site refused it.
    assert refusals, node.text()[-3000:]
    assert refusals[0]["node"] == "gpu-site"
    assert refusals[0]["reason"].startswith("site policy: the site has spent "), refusals
    assert "GPU-hours on this job, its maximum is 1e-06" in refusals[0]["reason"]
    assert "refused by the site policy" in node.text()

    # The site's audit log: what it ran, and the refusal with its reason, chained.
    show = cli("audit", "show", "--state-dir", str(state), "--json")
    assert show.returncode == 0, show.stderr
    records = json.loads(show.stdout)
    actions = [r["action"] for r in records]
    assert "policy.refused" in actions and any(a.startswith("task.") for a in actions)
    refused = next(r for r in records if r["action"] == "policy.refused")
    assert refused["outcome"] == "REFUSED" and job_id in refused["target"]
    ok = cli("audit", "verify", "--state-dir", str(state))
    assert ok.returncode == 0 and ok.stdout.startswith("ok: "), ok.stderr

    # An edit anywhere is found, and named by its line.
    log = state / "audit.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if '"policy.refused"' in line)
    lines[at] = lines[at].replace('"REFUSED"', '"OK"')
    log.write_text("".join(lines))
    bad = cli("audit", "verify", "--state-dir", str(state))
    assert bad.returncode == 1
    assert f"audit.jsonl:{at + 1}: edited: the record does not match its hash" in bad.stderr
