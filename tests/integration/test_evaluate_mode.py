"""mode = "evaluate" with real processes on loopback: an aggregator that stays up, two digits
sites. A one-round training job leaves a model; an evaluate job scores it by the job's id
(model_from_job) and another scores the same model uploaded as initial_weights. Both measure
on each site what the training job's final evaluation measured (the same model on the same
held-out splits), upload no update, and show the result in `job status` (and --json) and
`fedgpu rounds`. Job files that make no sense for it are refused at submit, nothing queued."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.federation import OPERATOR_TOKEN, Federation, cli, write_job, write_mode_job
from tests.integration.test_jobs import job_cli, wait_job

ENDED = ("finished", "failed", "stopped")


@pytest.fixture
def sites(federation: Federation, tmp_path: Path, digits_split: list[Path]) -> Federation:
    federation.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1")
    federation.start_node("site-a", digits_split[0], "--gpu", "none")
    federation.start_node("site-b", digits_split[1], "--gpu", "none")
    return federation


def eval_job(path: Path, **keys: object) -> Path:
    return write_mode_job(path, "evaluate", **keys)


def per_site(ev: dict) -> dict[str, float]:
    return {f"{e['node']} {k}": float(v) for e in ev["per_node"]
            for k, v in (("examples", e["num_examples"]), ("accuracy", e["metrics"]["accuracy"]),
                         ("loss", e["metrics"]["loss"]))}


def test_an_evaluate_job_scores_a_model_on_every_site_without_training(
        sites: Federation, tmp_path: Path) -> None:
    fed = sites
    trained = job_cli(fed, "submit", str(write_job(tmp_path / "train.toml", rounds=1)))
    done = wait_job(fed, trained["job_id"], ENDED)
    assert done["state"] == "finished", done
    final = fed.query("ListRounds", job_id=trained["job_id"])["rounds"][-1]["eval"]
    assert final and final["nodes"] == 2, final

    by_id = job_cli(fed, "submit", str(eval_job(tmp_path / "by-id.toml",
                                                model_from_job=trained["job_id"])))
    # The sites' training speed is known by now, but an evaluate job trains nothing.
    assert by_id["estimate"] is None, by_id
    model = tmp_path / "trained.safetensors"
    r = cli("job", "model", trained["job_id"], "--out", str(model), "--address", fed.address,
            operator_token=OPERATOR_TOKEN)
    assert r.returncode == 0, r.stderr
    uploaded = job_cli(fed, "submit", str(eval_job(tmp_path / "upload.toml",
                                                   initial_weights=model.name)))
    for job in (by_id, uploaded):
        ended = wait_job(fed, job["job_id"], ENDED, timeout=120)
        assert ended["state"] == "finished", ended
        assert ended["rounds_done"] == 1 and ended["rounds"] == 1, ended
        doc = fed.query("GetJob", job_id=job["job_id"])  # `job status --json`
        ev = doc["evaluation"]
        # The same model on the same held-out splits: what the training job's final
        # evaluation measured, site by site, and weighted by examples.
        assert per_site(ev) == pytest.approx(per_site(final)), (ev, final)
        assert ev["accuracy"] == pytest.approx(final["accuracy"])
        assert ev["num_examples"] == final["num_examples"] > 0
        assert doc["accuracy"] == pytest.approx(final["accuracy"])
        (rnd,) = fed.query("ListRounds", job_id=job["job_id"])["rounds"]
        # One round, nothing trained, no update uploaded.
        assert rnd["status"] == "finished" and rnd["nodes_reporting"] == 2, rnd
        assert rnd["num_examples"] == 0 and rnd["bytes_received"] == 0, rnd
        assert rnd["train_loss"] is None and rnd["eval"]["accuracy"] == ev["accuracy"]

    r = cli("job", "status", by_id["job_id"], "--address", fed.address,
            operator_token=OPERATOR_TOKEN)
    assert r.returncode == 0, r.stderr
    assert "evaluation of the job's model on each site's held-out data" in r.stdout, r.stdout
    assert "  site-a: accuracy " in r.stdout and "  site-b: accuracy " in r.stdout, r.stdout
    assert "weighted by examples: accuracy " in r.stdout, r.stdout
    r = cli("rounds", "--job", by_id["job_id"], "--address", fed.address,
            operator_token=OPERATOR_TOKEN)
    assert r.returncode == 0 and f"{final['accuracy']:.4f}" in r.stdout, r.stdout

    # Refused at submit (the rules of the job file: tests/unit/test_evaluate_mode.py); nothing
    # is queued.
    listed = len(fed.query("ListJobs"))
    r = cli("job", "submit", str(eval_job(tmp_path / "bad.toml", model_from_job="0123456789ab")),
            "--address", fed.address, operator_token=OPERATOR_TOKEN)
    assert r.returncode != 0 and "no job '0123456789ab'" in r.stderr, r.stderr
    assert len(fed.query("ListJobs")) == listed
