"""GPU-aware job admission with real node agents on simulated GPUs: the agents load the real
nvidia-ml-py against the fake libnvidia-ml.so.1, whose inventory the test rewrites while
everything runs (the fake re-reads it at every call), so "free memory now" is what decides.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.fixtures.fake_nvml import FakeNvml, fake_uuid, write_inventory
from tests.fixtures.federation import Federation, write_job
from tests.integration.test_jobs import job_cli, wait_job


def start(fed: Federation, fake: FakeNvml, tmp: Path, sites: dict[str, tuple[Path, list[str]]],
          data: list[Path]) -> dict[str, int]:
    """The aggregator (no job, heartbeats every second) and one agent per site, each seeing
    the GPUs of its own inventory file; their pids."""
    fed.start_server(None, "--state-dir", str(tmp / "state"), "--heartbeat-s", "1")
    pids = {}
    for (name, (inventory, flags)), split in zip(sites.items(), data, strict=False):
        env = fake.env({"FEDGPU_SIMULATED_GPUS": "1", "FEDGPU_TOKEN": fed.token,
                        "PYTHONUNBUFFERED": "1"})
        env["FAKE_NVML_CONFIG"] = str(inventory)
        pids[name] = fed.start_node(name, split, *flags, env=env).popen.pid
    return pids


def parts_when(fed: Federation, job_id: str, names: set[str], timeout: float = 120
               ) -> dict[str, Any]:
    """`job status` once every named site is listed as ineligible."""
    end = time.monotonic() + timeout
    doc: dict[str, Any] = {}
    while time.monotonic() < end:
        doc = job_cli(fed, "status", job_id)
        parts = {p["name"]: p for p in doc["nodes"]}
        if doc["state"] == "waiting" and all(n in parts and not parts[n]["eligible"]
                                             for n in names):
            return doc
        time.sleep(0.5)
    raise AssertionError(f"never waiting on {names}: {doc}")


def test_a_required_gpu_job_waits_with_each_sites_reason_until_the_gpus_free_up(
        fake_nvml: FakeNvml, federation: Federation, tmp_path: Path,
        digits_split: list[Path]) -> None:
    fed = federation
    inv_a, inv_b = tmp_path / "a.conf", tmp_path / "b.conf"
    write_inventory(inv_a, [{"memory_total_mib": 16000, "memory_used_mib": 12000}])
    write_inventory(inv_b, [{"memory_total_mib": 24000, "memory_used_mib": 21000},
                            {"memory_total_mib": 24000, "memory_used_mib": 19000}])
    pids = start(fed, fake_nvml, tmp_path, {"site-a": (inv_a, ["--gpu", "offer"]),
                                            "site-b": (inv_b, ["--gpu", "offer"])},
                 digits_split)
    job = write_job(tmp_path / "job.toml", rounds=2, min_nodes=2, use_gpu=None,
                    resources={"gpu": "required", "min_gpu_free_mib": 8000})
    job_id = job_cli(fed, "submit", str(job))["job_id"]

    doc = parts_when(fed, job_id, {"site-a", "site-b"})
    assert doc["reason"].startswith("0 of the 2 nodes it needs can take it"), doc
    parts = {p["name"]: p["reason"] for p in doc["nodes"]}
    for reason in parts.values():
        assert reason.startswith('the job requires a GPU (gpu = "required") and no GPU has '
                                 "8000 MiB free (job min_gpu_free_mib 8000)"), reason
    assert parts["site-a"].endswith(": GPU 0 4000 MiB free")
    assert parts["site-b"].endswith(": GPU 0 3000 MiB free, GPU 1 5000 MiB free")
    # Waiting means nothing runs: no round opened, no node asked to train.
    for _ in range(3):
        doc = job_cli(fed, "status", job_id)
        assert doc["state"] == "waiting" and doc["current_round"] is None, doc
    assert fed.query("ListRounds", job_id=job_id)["rounds"] == []

    # Other work on the cards ends: each agent's next heartbeat reports the free memory, and
    # the job starts and finishes on the same processes, nothing restarted.
    write_inventory(inv_a, [{"memory_total_mib": 16000, "memory_used_mib": 2000}])
    write_inventory(inv_b, [{"memory_total_mib": 24000, "memory_used_mib": 21000},
                            {"memory_total_mib": 24000, "memory_used_mib": 1000}])
    done = wait_job(fed, job_id, ("finished", "failed", "stopped"))
    assert done["state"] == "finished", done
    rounds = fed.query("ListRounds", job_id=job_id)["rounds"]
    assert [r["status"] for r in rounds] == ["finished", "finished"]
    for rnd in rounds:
        decisions = {u["node"]: u["gpu_decision"] for u in rnd["updates"]}
        assert decisions["site-a"]["gpu_uuid"] == fake_uuid(0)
        # The card with room, not the first one.
        assert decisions["site-b"]["gpu_uuid"] == fake_uuid(1)
        for d in decisions.values():
            assert d["device"] == "cuda" and "min_gpu_free_mib 8000" in d["reason"], d
    assert {p.name: p.popen.pid for p in fed.procs if p.name.startswith("site-")} == pids
    assert all(p.popen.poll() is None for p in fed.procs)


def test_preferred_runs_on_cpu_where_no_gpu_fits_and_none_never_uses_a_gpu(
        fake_nvml: FakeNvml, federation: Federation, tmp_path: Path,
        digits_split: list[Path]) -> None:
    fed = federation
    busy, idle = tmp_path / "busy.conf", tmp_path / "idle.conf"
    write_inventory(busy, [{"memory_total_mib": 16000, "memory_used_mib": 12000}])
    write_inventory(idle, [{"memory_total_mib": 16000, "memory_used_mib": 1000}])
    start(fed, fake_nvml, tmp_path, {"offer": (busy, ["--gpu", "offer"]),
                                     "cpu": (idle, ["--gpu", "none"]),
                                     "enforce": (idle, ["--gpu", "enforce"])}, digits_split)

    preferred = write_job(tmp_path / "preferred.toml", rounds=1, min_nodes=3, use_gpu=None,
                          resources={"gpu": "preferred", "min_gpu_free_mib": 8000})
    job_id = job_cli(fed, "submit", str(preferred))["job_id"]
    assert wait_job(fed, job_id, ("finished", "failed"))["state"] == "finished"
    (rnd,) = fed.query("ListRounds", job_id=job_id)["rounds"]
    used = {u["node"]: u for u in rnd["updates"]}
    # No GPU of the offering site has 8000 MiB free: it trains on its CPU, and says why.
    assert used["offer"]["gpu_decision"]["device"] == "cpu"
    assert "no usable GPU" in used["offer"]["gpu_decision"]["reason"]
    assert "min_gpu_free_mib 8000" in used["offer"]["gpu_decision"]["reason"]
    assert used["offer"]["resources"]["device"] == "cpu"
    assert used["cpu"]["gpu_decision"]["device"] == "cpu"
    assert used["enforce"]["gpu_decision"]["device"] == "cuda"

    # gpu = "none" (use_gpu = false): a site that trains on GPUs only cannot take it; with
    # three nodes needed the job waits and says so.
    none3 = write_job(tmp_path / "none3.toml", rounds=1, min_nodes=3, use_gpu=False)
    waiting = job_cli(fed, "submit", str(none3))["job_id"]
    doc = parts_when(fed, waiting, {"enforce"})
    parts = {p["name"]: p for p in doc["nodes"]}
    assert parts["offer"]["eligible"] and parts["cpu"]["eligible"]
    assert parts["enforce"]["reason"] == ('the job uses no GPU (gpu = "none") and this site '
                                          "trains on a GPU only (--gpu enforce)")
    job_cli(fed, "stop", waiting)
    assert wait_job(fed, waiting, ("stopped", "finished", "failed"), 60)["state"] == "stopped"

    none2 = write_job(tmp_path / "none2.toml", rounds=1, min_nodes=2, use_gpu=None,
                      resources={"gpu": "none"})
    job_id = job_cli(fed, "submit", str(none2))["job_id"]
    assert wait_job(fed, job_id, ("finished", "failed"))["state"] == "finished"
    rounds = fed.query("ListRounds", job_id=job_id)["rounds"]
    assert [r["status"] for r in rounds] == ["finished"]
    names = {u["node"] for u in rounds[0]["updates"]}
    assert names == {"offer", "cpu"}  # the enforcing site is never sampled
    for u in rounds[0]["updates"]:
        # A free GPU (the cpu site's card has 15000 MiB free) is still not used.
        assert u["gpu_decision"]["device"] == "cpu" and u["resources"]["device"] == "cpu"
        assert u["resources"]["nvml_used_peak_mib"] is None


def test_a_site_that_cannot_give_the_workers_a_job_asks_for_says_why(
        fake_nvml: FakeNvml, federation: Federation, tmp_path: Path,
        digits_split: list[Path]) -> None:
    """[resources] workers: the node chooses its devices at admission (node/worker_devices.py)
    and answers a task it cannot staff as ineligible, with the shortfall."""
    fed = federation
    inv = tmp_path / "one.conf"
    write_inventory(inv, [{"memory_total_mib": 16000, "memory_used_mib": 2000}])
    start(fed, fake_nvml, tmp_path, {"site-a": (inv, ["--gpu", "enforce"])}, digits_split)
    job = write_job(tmp_path / "job.toml", rounds=1, min_nodes=1, use_gpu=None,
                    round_deadline_s=30, resources={"gpu": "required", "workers": 2})
    job_id = job_cli(fed, "submit", str(job))["job_id"]
    end = time.monotonic() + 120
    refused: list[dict[str, Any]] = []
    while time.monotonic() < end and not refused:
        refused = [i for r in fed.query("ListRounds", job_id=job_id)["rounds"]
                   for i in r.get("ineligible") or ()]
        cur = job_cli(fed, "status", job_id).get("current_round") or {}
        refused = refused or [i for i in cur.get("ineligible") or ()]
        time.sleep(0.5)
    job_cli(fed, "stop", job_id)
    assert refused, "the site never refused the task"
    assert refused[0]["node"] == "site-a"
    assert refused[0]["reason"].startswith("this site can give 1 of the 2 GPUs the job asks "
                                           "for: it has 1 device"), refused[0]
