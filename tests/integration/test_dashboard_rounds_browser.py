"""The rounds table's secure-aggregation, local-work and per-site evaluation columns, in a real
headless Chromium: the dashboard's HTTP server on loopback serves fixed documents (a plain
round, a secure round with a site dropped and recovered, a secure round that failed, a
time-budgeted round with its evaluation per site) and the page must show each round's figures
in its row, as text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.browser import fixed_dashboard, new_driver, wait_for

TOKEN = "operator-secret"
STATUS = {"run_id": "r1", "job_id": None, "state": "running", "error": None, "task": "digits",
          "mode": "star", "strategy": "fedavg", "round": 4, "rounds": 5,
          "current_round": None, "nodes": {"registered": 3, "alive": 3}, "accuracy": None,
          "loss": None, "rejections": {}, "uptime_s": 12.0, "version": "test"}
NODES = {"nodes": [{"name": n, "state": "idle", "alive": True, "address": "x",
                    "version": "test", "rounds_completed": 1, "rounds_failed": 0,
                    "gpu_decision": {"device": "cpu"}, "devices": {"gpus": []}}
                   for n in ("fast-a", "slow-b", "slow-c")]}


def _update(node: str, steps: float, examples: float) -> dict[str, Any]:
    return {"node": node, "num_examples": 0, "upload_s": 0.2, "resources": {},
            "train_metrics": {"loss": 0.4, "steps": steps, "examples": examples}}


def _round(number: int, status: str = "finished", **extra: Any) -> dict[str, Any]:
    return {"round": number, "attempt": 1, "status": status, "started_at": 1.0,
            "duration_s": 3.0, "participants": ["fast-a", "slow-b", "slow-c"],
            "nodes_reporting": 3, "dropped": [], "train_loss": 0.4, "num_examples": 30,
            "bytes_received": 10, "aggregation_s": 0.01, "rejected": [], "failures": [],
            "eval": None, **extra,
            "updates": extra.get("updates", [_update("fast-a", 4, 40)])}


ROUNDS = {"run_id": "r1", "initial_eval": None, "rounds": [
    _round(1),
    _round(2, secure_aggregation={
        "sites": 3, "threshold": 2, "neighbours": 2, "protocol_s": 1.23, "ring_bits": 32,
        "max_weight": 512, "masked": 2, "dropped": {"masked-input": ["slow-c"]},
        "recovered": 1, "total_weight": 700, "unmask_s": 0.04}),
    _round(3, status="retried", secure_aggregation={
        "sites": 3, "threshold": 2, "neighbours": 2, "protocol_s": 0.5, "ring_bits": 32,
        "max_weight": 512,
        "failed": {"stage": "share-keys", "reason": "1 of 2 shareholders"}}),
    # Its evaluation per site (the latest round's only: an evaluate job's one round).
    _round(4, round_train_s=2.0, eval={
        "loss": 0.5, "accuracy": 0.875, "num_examples": 400, "nodes": 2, "per_node": [
            {"node_id": "n2", "node": "slow-b", "num_examples": 300,
             "metrics": {"loss": 0.6, "accuracy": 0.9}},
            {"node_id": "n1", "node": "fast-a", "num_examples": 100,
             "metrics": {"loss": 0.2, "accuracy": 0.8}}]}, updates=[
        _update("fast-a", 400, 12800), _update("slow-b", 55, 1760), _update("slow-c", 60, 1920)]),
]}


@pytest.fixture
def url() -> Iterator[str]:
    with fixed_dashboard(STATUS, NODES, ROUNDS, TOKEN) as address:
        yield address

def test_rounds_show_secure_aggregation_and_work_per_site(url: str, tmp_path: Path) -> None:
    driver = new_driver(tmp_path)
    try:
        driver.get(url)
        wait_for(lambda: driver.current_url.endswith("/login"), 20, "the login form")
        driver.find_element("id", "token").send_keys(TOKEN)
        driver.find_element("css selector", "#login-form button").click()
        rows = wait_for(lambda: driver.execute_script("""
          const rows = [...document.querySelectorAll('#rounds-table tbody tr')];
          return rows.length === 4 && Object.fromEntries(rows.map((tr) => [tr.dataset.round, {
            secure: tr.querySelector('td.secure').textContent,
            work: tr.querySelector('td.work').textContent,
            perSite: [...tr.querySelectorAll('td.work details li')].map((li) => li.textContent),
            accuracy: tr.querySelector('td.accuracy').firstChild.textContent,
            evalSites: [...tr.querySelectorAll('td.accuracy details li')]
              .map((li) => li.textContent),
          }]));
        """), 30, "the rounds table")
        assert rows["1"] == {"secure": "-", "work": "-", "perSite": [], "accuracy": "-",
                             "evalSites": []}
        assert rows["4"]["accuracy"] == "0.875"
        assert rows["4"]["evalSites"] == ["fast-a: accuracy 0.800, loss 0.200 on 100 examples",
                                          "slow-b: accuracy 0.900, loss 0.600 on 300 examples"]
        secure = rows["2"]["secure"]
        for part in ("2 / 3 masked", "dropped: masked-input 1", "1 recovered",
                     "protocol 1.23 s (unmask 0.04 s)", "Z_2^32"):
            assert part in secure, secure
        assert "failed at share-keys: 1 of 2 shareholders" in rows["3"]["secure"]
        assert rows["4"]["secure"] == "-"
        work = rows["4"]["work"]
        assert "55–400 steps · 1760–12800 examples" in work and "budget 2.0 s" in work, work
        assert rows["4"]["perSite"] == ["fast-a: 400 steps, 12800 examples",
                                        "slow-b: 55 steps, 1760 examples",
                                        "slow-c: 60 steps, 1920 examples"]
        assert driver.execute_script("return window.fedgpuDash.error") is None
    finally:
        driver.quit()
