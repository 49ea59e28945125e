"""Differential privacy on a real federation (aggregator and two digits nodes as processes on
loopback): a central-DP job that ends when its budget would be exceeded, with the spent
epsilon in `job status --json`, `fedgpu rounds --json` and the metrics endpoint; a local-DP job
with DP-SGD on the nodes; a distributed-DP job under secure aggregation whose sites add the noise
shares and whose budget ends it; "distributed" without secure aggregation refused at submit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedgpu.core.privacy.accountant import RoundEvent, epsilon_of
from tests.fixtures.federation import Federation, cli, free_port, write_job
from tests.integration.test_jobs import job_cli, wait_job
from tests.integration.test_operator import samples, scrape


@pytest.fixture
def site(federation: Federation, tmp_path: Path, digits_split: list[Path]) -> Federation:
    federation.metrics_port = free_port()  # type: ignore[attr-defined]
    federation.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1",
                            "--metrics-port", str(federation.metrics_port))  # type: ignore[attr-defined]
    federation.start_node("site-a", digits_split[0], "--gpu", "none")
    federation.start_node("site-b", digits_split[1], "--gpu", "none")
    return federation


def test_central_dp_job_finishes_when_the_budget_would_be_exceeded(
        site: Federation, tmp_path: Path) -> None:
    # z = 3: 1.39 after one round, 2.03 after two, 2.54 after three (RDP, delta 1e-5).
    job = write_job(tmp_path / "dp.toml", rounds=10, name="central-dp",
                    privacy={"mode": "central", "clip_norm": 1.0, "noise_multiplier": 3.0,
                             "target_epsilon": 2.3})
    submitted = job_cli(site, "submit", str(job))
    done = wait_job(site, submitted["job_id"], ("finished", "failed", "stopped"))
    assert done["state"] == "finished", done
    two = epsilon_of([RoundEvent(1.0, 3.0)] * 2, 1e-5)
    # Why it ended, with what it spent of the target.
    assert done["reason"] == f"privacy budget spent after 2 rounds, epsilon {two:.2f} of 2.3"
    assert done["rounds_done"] == 2
    status = job_cli(site, "status", submitted["job_id"])
    p = status["privacy"]
    assert p["mode"] == "central" and p["target_epsilon"] == 2.3 and p["rounds_accounted"] == 2
    assert p["epsilon_spent"] == pytest.approx(two, abs=1e-5)
    assert [r["round"] for r in p["per_round"]] == [1, 2]
    assert p["per_round"][0]["epsilon"] == pytest.approx(epsilon_of([RoundEvent(1.0, 3.0)],
                                                                    1e-5), abs=1e-5)
    human = cli("job", "status", submitted["job_id"], "--address", site.address).stdout
    assert f"privacy (central): epsilon {two:.4f} of 2.3 spent at delta 1e-05 over 2 round(s)" \
        in human, human
    assert "finished — privacy budget spent" in human, human
    # `status --json`: why it ended, and the epsilon spent of the target.
    st = json.loads(cli("status", "--address", site.address, "--job", submitted["job_id"],
                        "--json").stdout)
    assert st["reason"] == done["reason"]
    assert st["privacy"]["epsilon_spent"] == pytest.approx(two, abs=1e-5)
    assert (st["privacy"]["target_epsilon"], st["privacy"]["rounds_accounted"]) == (2.3, 2)
    r = cli("rounds", "--address", site.address, "--job", submitted["job_id"], "--json")
    rounds = [x for x in json.loads(r.stdout)["rounds"] if x["status"] == "finished"]
    assert [x["privacy"]["epsilon"] for x in rounds] == [e["epsilon"] for e in p["per_round"]]
    assert all(x["privacy"]["updates"] == 2 and x["privacy"]["noise_std"] == pytest.approx(
        3.0 * 1.0 / 2) for x in rounds)
    code, _, text = scrape(site.metrics_port)  # type: ignore[attr-defined]
    assert code == 200
    got = samples(text)
    assert got[("fedgpu_privacy_epsilon_spent", ())] == pytest.approx(two, abs=1e-5)
    assert got[("fedgpu_privacy_epsilon_target", ())] == 2.3
    events = job_cli(site, "logs", submitted["job_id"])
    assert any("privacy budget spent" in e["message"] for e in events), events


def test_local_dp_with_dp_sgd_on_the_nodes(site: Federation, tmp_path: Path) -> None:
    job = write_job(tmp_path / "ldp.toml", rounds=2, name="local-dp",
                    hyperparameters={"lr": 0.1, "dp_sgd": True, "noise_multiplier": 1.0,
                                     "max_grad_norm": 1.0},
                    privacy={"mode": "local", "clip_norm": 5.0, "noise_multiplier": 0.01})
    submitted = job_cli(site, "submit", str(job))
    done = wait_job(site, submitted["job_id"], ("finished", "failed", "stopped"))
    assert done["state"] == "finished" and done["reason"] is None, done
    r = cli("rounds", "--address", site.address, "--job", submitted["job_id"], "--json")
    rounds = [x for x in json.loads(r.stdout)["rounds"] if x["status"] == "finished"]
    assert len(rounds) == 2
    for rec in rounds:
        assert rec["privacy"]["mode"] == "local"
        for u in rec["updates"]:
            m = u["train_metrics"]
            # Example-level: Opacus's epsilon for the node; client-level: the update's clip.
            assert m["dp_epsilon"] > 0 and m["dp_noise_multiplier"] == 1.0
            assert m["ldp_noise_std"] == pytest.approx(0.05)
            # Nothing computed before the noise leaves the site (node/clear_fields.py): not
            # the update's norm, whether it was clipped, the loss or the step count.
            assert set(m) <= {"ldp_noise_std", "dp_epsilon", "dp_epsilon_total", "dp_delta",
                              "dp_noise_multiplier", "update_bytes"}, m
    # Local DP accounts with the replace-one-node sensitivity 2C: multiplier 0.01 / 2.
    assert rounds[-1]["privacy"]["epsilon"] > 1000


def test_distributed_dp_job_under_secure_aggregation_spends_its_budget(
        site: Federation, tmp_path: Path) -> None:
    # z = 3, C = 1: the same account as the central job above (2 rounds fit in 2.3). Two sites,
    # threshold 2: each adds noise of std 3 / sqrt(2); the range holds 1 + 6 x 2.12 = 13.7.
    job = write_job(tmp_path / "ddp.toml", rounds=10, name="distributed-dp",
                    privacy={"mode": "distributed", "clip_norm": 1.0, "noise_multiplier": 3.0,
                             "target_epsilon": 2.3},
                    secure_aggregation={"clip": 16.0, "stage_timeout_s": 60})
    submitted = job_cli(site, "submit", str(job))
    done = wait_job(site, submitted["job_id"], ("finished", "failed", "stopped"))
    assert done["state"] == "finished", done
    assert done["reason"].startswith("privacy budget spent after 2 rounds, epsilon ")
    assert done["rounds_done"] == 2, done
    p = job_cli(site, "status", submitted["job_id"])["privacy"]
    two = epsilon_of([RoundEvent(1.0, 3.0)] * 2, 1e-5)
    assert p["mode"] == "distributed" and p["rounds_accounted"] == 2
    assert p["epsilon_spent"] == pytest.approx(two, abs=1e-5)
    r = cli("rounds", "--address", site.address, "--job", submitted["job_id"], "--json")
    rounds = [x for x in json.loads(r.stdout)["rounds"] if x["status"] == "finished"]
    assert [x["privacy"]["epsilon"] for x in rounds] == [e["epsilon"] for e in p["per_round"]]
    share = 3.0 / 2 ** 0.5
    for rec in rounds:
        sa, priv = rec["secure_aggregation"], rec["privacy"]
        assert (sa["masked"], sa["threshold"]) == (2, 2), sa
        # Every site weighs 1: the unmasked total weight is the count of sites.
        assert sa["total_weight"] == 2 == priv["updates"]
        assert priv["min_sites"] == 2 and priv["share_std"] == pytest.approx(share)
        assert priv["noise_std"] == pytest.approx(3.0 / 2)  # z C sqrt(m / n_min) / m
        for u in rec["updates"]:
            m = u["train_metrics"]
            # Only the share's std: the update's norm, the values the range cut, the loss
            # stay on the site (facts about one site's update).
            assert m == {"ddp_noise_std": pytest.approx(share)}, m


def test_distributed_dp_without_secure_aggregation_is_refused_at_submit(
        federation: Federation, tmp_path: Path) -> None:
    # Refused at submission: the aggregator alone decides (nodes would only add start-up time).
    site = federation
    site.start_server(None, "--state-dir", str(tmp_path / "state"))
    job = write_job(tmp_path / "ddp.toml", privacy={"mode": "distributed", "clip_norm": 1.0,
                                                    "noise_multiplier": 1.0})
    r = cli("job", "submit", str(job), "--address", site.address, "--json",
            operator_token=site.operator_token)
    assert r.returncode != 0 and "needs secure_aggregation" in r.stderr, r.stderr
    assert job_cli(site, "list") == []
