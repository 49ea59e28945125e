"""The cross-site matrix panel (server/views/ui/cross_site.js) and the slow-link lines under
the rounds table (app.js linkLines), in a real headless Chromium: the dashboard's HTTP server on
loopback serves fixed documents (a cross-site job's matrix with a site that kept its model, an
open round with an upload in flight, a round that left a slow site out and asked another to
compress) and the page must show each figure and reason as text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.browser import fixed_dashboard, new_driver, wait_for
from tests.integration.test_dashboard_rounds_browser import NODES, TOKEN, _round

KEPT = "site policy: share_local_model is not true"


def _score(acc: float, n: int) -> dict[str, Any]:
    return {"accuracy": acc, "loss": 1 - acc, "num_examples": n}


MATRIX = {"of_job": "4f2a", "sites": ["site-a", "site-b"], "rows": [
    {"model": "global", "round": 3, "why_not": None, "weighted": {"accuracy": 0.85},
     "cells": {"site-a": _score(0.8, 100), "site-b": _score(0.9, 100)}},
    {"model": "site-a", "round": 2, "why_not": None, "weighted": {"accuracy": 0.7},
     "cells": {"site-a": _score(0.95, 100), "site-b": {"why_not": "no answer"}}},
    {"model": "site-b", "round": None, "why_not": KEPT, "weighted": None, "cells": {}},
]}
STATUS = {"run_id": "r2", "job_id": "9c1d", "state": "finished", "error": None,
          "task": "digits", "mode": "cross-site", "strategy": "fedavg", "round": 3,
          "rounds": 3, "current_round": None, "nodes": {"registered": 3, "alive": 3},
          "accuracy": 0.85, "loss": None, "rejections": {}, "uptime_s": 12.0,
          "version": "test", "cross_site": MATRIX}
SLOW = "needs ~180 s at 2.1 Mbit/s, deadline 15 s"
ROUNDS = {"run_id": "r2", "initial_eval": None,
          "rounds": [_round(1, link={"skipped": [{"node": "slow-c", "reason": SLOW}],
                                     "compressed": [{"node": "slow-b",
                                                     "reason": "int8 to make the deadline"}]})],
          "open": {"round": 2, "deadline_in_s": 12.4, "sites": [
              {"node": "slow-b", "state": "working", "phase": "uploading", "direction": "up",
               "bytes": 2_000_000, "size": 8_000_000, "rate_bytes_per_s": 262_500,
               "time_left_s": 22.9},
              {"node": "fast-a", "state": "assigned", "phase": "training",
               "last": {"direction": "down", "bytes": 8_000_000, "seconds": 0.5,
                        "rate_bytes_per_s": 16_000_000}}]}}


@pytest.fixture
def url() -> Iterator[str]:
    with fixed_dashboard(STATUS, NODES, ROUNDS, TOKEN) as address:
        yield address

def test_cross_site_matrix_and_slow_links_show_in_the_page(url: str, tmp_path: Path) -> None:
    driver = new_driver(tmp_path)
    try:
        driver.get(url)
        wait_for(lambda: driver.current_url.endswith("/login"), 20, "the login form")
        driver.find_element("id", "token").send_keys(TOKEN)
        driver.find_element("css selector", "#login-form button").click()
        matrix = wait_for(lambda: driver.execute_script("""
          const panel = document.getElementById('cross-site');
          const rows = [...document.querySelectorAll('#cross-site-table tbody tr')];
          return !panel.hidden && rows.length === 3 && {
            head: [...document.querySelectorAll('#cross-site-table thead th')]
              .map((th) => th.textContent),
            rows: rows.map((tr) => [...tr.children].map((c) => c.textContent)),
            why: [...document.querySelectorAll('#cross-site-table td.why-not')]
              .map((td) => td.title || td.textContent),
          };
        """), 30, "the cross-site panel")
        assert matrix["head"] == ["model \\ data", "site-a", "site-b", "weighted"]
        assert matrix["rows"][0] == ["global", "0.8000", "0.9000", "0.8500"]
        assert matrix["rows"][1] == ["site-a (local)", "0.9500", "–", "0.7000"]
        assert matrix["rows"][2] == ["site-b (local)", KEPT]
        assert matrix["why"] == ["no answer", KEPT]
        lines = wait_for(lambda: driver.execute_script("""
          const items = [...document.querySelectorAll('#round-links li')];
          return items.length >= 5 && items.map((li) => li.textContent);
        """), 30, "the slow-link lines")
        assert lines[0] == "round 2: deadline in 12 s", lines
        assert lines[1] == "slow-b uploading up 2.0/8.0 MB at 2.1 Mbit/s ~23 s left", lines
        # A download that ended this round: the rate it was sent at.
        assert lines[2] == "fast-a training (down 8.0 MB in 0.5 s at 128.0 Mbit/s)", lines
        assert f"skipped slow-c: {SLOW}" in lines, lines
        assert "compressed slow-b: int8 to make the deadline" in lines, lines
        assert driver.execute_script("return window.fedgpuDash.error") is None
    finally:
        driver.quit()
