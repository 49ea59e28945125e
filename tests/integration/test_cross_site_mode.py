"""mode = "cross-site" with real processes on loopback: an aggregator that stays up, two
digits sites. A one-round training job leaves a global model and, on each site, its local
model (node/local_models.py); a cross-site job then scores each on every site's held-out data.

site-a shares its local model (policy share_local_model = true); site-b has no policy, so by
default it refuses: its row says why, its column still scores the others' models. The global
model's row is what the training job's final evaluation measured (the same model on the same
splits); a local model differs from it.

Threat model (docs/how-to/cross-site-evaluation.md): a site's local model leaves it only on
its own policy's word; the test checks that a site that did not say so sends nothing (its
row is empty with the reason, and its audit log records the refusal)."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest

from tests.fixtures.federation import (
    OPERATOR_TOKEN,
    Federation,
    cli,
    free_port,
    write_job,
    write_mode_job,
)
from tests.integration.test_jobs import job_cli, wait_job

ENDED = ("finished", "failed", "stopped")


@pytest.fixture
def sites(federation: Federation, tmp_path: Path, digits_split: list[Path]) -> Federation:
    federation.ui_port = free_port()  # type: ignore[attr-defined]
    federation.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1",
                            "--ui-port", str(federation.ui_port))  # type: ignore[attr-defined]
    share = tmp_path / "share.toml"
    share.write_text("share_local_model = true\n")
    federation.start_node("site-a", digits_split[0], "--gpu", "none", "--policy", str(share))
    federation.start_node("site-b", digits_split[1], "--gpu", "none",
                          "--state-dir", str(tmp_path / "site-b"))
    return federation


def cross_job(path: Path, **keys: object) -> Path:
    return write_mode_job(path, "cross-site", **keys)


def test_cross_site_scores_every_model_on_every_site_and_a_site_may_refuse(
        sites: Federation, tmp_path: Path) -> None:
    fed = sites
    trained = job_cli(fed, "submit", str(write_job(tmp_path / "train.toml", rounds=1)))
    done = wait_job(fed, trained["job_id"], ENDED)
    assert done["state"] == "finished", done
    final = fed.query("ListRounds", job_id=trained["job_id"])["rounds"][-1]["eval"]

    job = job_cli(fed, "submit", str(cross_job(tmp_path / "cross.toml",
                                               model_from_job=trained["job_id"])))
    assert job["estimate"] is None, job
    ended = wait_job(fed, job["job_id"], ENDED, timeout=180)
    assert ended["state"] == "finished", ended
    assert ended["rounds_done"] == 1 and ended["rounds"] == 1, ended
    m = fed.query("GetJob", job_id=job["job_id"])["cross_site"]  # `job status --json`
    assert m["of_job"] == trained["job_id"] and m["sites"] == ["site-a", "site-b"], m
    rows = {r["model"]: r for r in m["rows"]}
    assert list(rows) == ["global", "site-a", "site-b"], rows
    # The global model on each site: what the training job's final evaluation measured.
    measured = {e["node"]: e["metrics"]["accuracy"] for e in final["per_node"]}
    assert {s: c["accuracy"] for s, c in rows["global"]["cells"].items()} == pytest.approx(
        measured)
    cells = rows["site-a"]["cells"]
    assert set(cells) == {"site-a", "site-b"}, cells
    assert all(0.0 <= c["accuracy"] <= 1.0 and c["num_examples"] > 0
               for c in cells.values()), cells
    # A site's own local model (one epoch on its data alone) is not the average.
    assert cells != rows["global"]["cells"], cells
    # site-b said nothing: its model stays home; its row says why, its column scores.
    assert rows["site-b"]["why_not"].startswith("site policy: none set"), rows["site-b"]
    assert rows["site-b"]["cells"] == {}
    assert m["not_sent"] == {"site-b": rows["site-b"]["why_not"]}
    audit = (tmp_path / "site-b" / "audit.jsonl").read_text()
    assert "task.local_model" in audit and "REFUSED" in audit, audit

    r = cli("job", "status", job["job_id"], "--address", fed.address,
            operator_token=OPERATOR_TOKEN)
    assert r.returncode == 0, r.stderr
    assert f"cross-site evaluation of job {trained['job_id']}" in r.stdout, r.stdout
    assert "site-a (local)" in r.stdout and "share_local_model = true" in r.stdout, r.stdout

    # The dashboard's cross-site panel (server/views/ui/cross_site.js) reads the same matrix
    # from /api/status.
    conn = http.client.HTTPConnection("127.0.0.1", fed.ui_port, timeout=10)  # type: ignore[attr-defined]
    conn.request("GET", "/api/status", headers={"Authorization": f"Bearer {fed.operator_token}"})
    api = json.loads(conn.getresponse().read())
    conn.close()
    assert api["cross_site"] == m and api["mode"] == "cross-site", api

    # The report: the matrix as a table in summary.md and a heat map.
    out = tmp_path / "report"
    r = cli("report", "--address", fed.address, "--job", job["job_id"], "--out", str(out),
            operator_token=OPERATOR_TOKEN)
    assert r.returncode == 0, r.stderr
    summary = (out / "summary.md").read_text()
    assert "## Cross-site evaluation" in summary and "| site-a (local) | 0." in summary, summary
    assert (out / "cross_site.png").stat().st_size > 0

    # Refused at submit, nothing queued: the training job must exist.
    listed = len(fed.query("ListJobs"))
    r = cli("job", "submit", str(cross_job(tmp_path / "bad.toml", model_from_job="0123abcd")),
            "--address", fed.address, operator_token=OPERATOR_TOKEN)
    assert r.returncode != 0 and "no job '0123abcd'" in r.stderr, r.stderr
    assert len(fed.query("ListJobs")) == listed
