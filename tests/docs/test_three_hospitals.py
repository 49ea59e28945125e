"""The three-hospitals tutorial (docs/tutorials/three-hospitals-two-studies.md) runs as written:
an aggregator and three real node processes on loopback, people with tokens and roles, two
studies, each site's own policy file, two jobs that train at the same time, the refusals, and
the audit logs of the aggregator and a site. Beyond each block's expected line, the test reads
what the run left: both jobs finished and their run intervals overlap, each refusal names its
reason, the audit chains verify, and no process the page started outlives it."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from tests.fixtures.doc_blocks import ROOT, run_page

PAGE = ROOT / "docs" / "tutorials" / "three-hospitals-two-studies.md"
PORTS = (50061, 50062)  # the page's aggregator: its gRPC port and the bulk port beside it


def _taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _processes_under(folder: Path) -> list[str]:
    """Processes whose working directory lies in `folder` (the page's processes run there)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(proc / "cwd"))
            state = (proc / "status").read_text()
        except OSError:
            continue
        if cwd.is_relative_to(folder) and "zombie" not in state.lower():
            found.append(f"{proc.name}: {(proc / 'cmdline').read_bytes()[:200]!r}")
    return found


def _output(results: list, command: str) -> str:
    (found,) = [r.output for r in results if command in r.block.text]
    return found


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


@pytest.mark.slow  # an aggregator, three nodes and two jobs: ~50 s on 2 idle cores
def test_three_hospitals_two_studies_runs_as_written(tmp_path: Path) -> None:
    if any(_taken(p) for p in PORTS):
        pytest.skip(f"127.0.0.1:{PORTS} is taken: the tutorial's aggregator uses these ports")
    results = run_page(PAGE, tmp_path)
    work = tmp_path / "checkout"
    assert not _processes_under(tmp_path), _processes_under(tmp_path)
    # The whole page stays a quick test (the issue asks well under 2 minutes).
    assert sum(r.seconds for r in results) < 120, [(r.block.where(), r.seconds) for r in results]

    # The two studies' jobs both finished, and ran at the same time.
    jobs = {j["job_id"]: j for j in json.loads((work / "jobs.json").read_text())}
    ids = _output(results, 'echo "onco job').strip().splitlines()[-1]
    onco, cardio = ids.removeprefix("onco job ").split(", cardio job ")
    assert {onco, cardio} == set(jobs), (ids, sorted(jobs))
    assert [jobs[j]["state"] for j in (onco, cardio)] == ["finished", "finished"]
    assert [jobs[j]["rounds_done"] for j in (onco, cardio)] == [2, 2]
    assert max(j["started_at"] for j in jobs.values()) < min(
        j["finished_at"] for j in jobs.values()), jobs

    # Each refusal says why: the site's policy at enrolment and at submit, the role per call.
    assert "this site serves 'cardio', not study 'onco'" in _output(
        results, "enrol onco hospital-c ||")
    refused = _output(results, "onco-long.toml -c olga")
    assert "site hospital-a would refuse this job: rounds = 20 is over" in refused
    assert "not queued" in refused and "exit code 1" in refused
    assert "hospital-c" not in refused  # not enrolled in onco: its policy is not asked
    acts = _output(results, "-c carl ||")
    assert "carl (researcher): this job belongs to study 'onco', not one of theirs" in acts
    assert (work / "onco.safetensors").stat().st_size > 0  # olga's own study's model
    assert "exit code 1" in _output(results, "job list -c vic ||")

    # The audit logs: each chain verifies, and names who was refused what.
    for verify in ("audit verify --state-dir aggregator", "audit verify --state-dir hospital-a"):
        assert "ok:" in _output(results, verify)
    records = _records(work / "aggregator" / "audit.jsonl")
    denied = {(r["actor"], r["action"]) for r in records if r["outcome"] == "PERMISSION_DENIED"}
    assert {("carl", "Admin.DownloadModel"), ("vic", "Admin.SubmitJob")} <= denied, denied
    assert {"Admin.AddUser", "Admin.CreateStudy", "node.register"} <= {
        r["action"] for r in records}
    # Hospital A trained the onco job's two rounds, and nothing of the cardio job's.
    site = [r["action"] for r in _records(work / "hospital-a" / "audit.jsonl")]
    assert site.count("task.train") == 2 and "task.init" in site, site
