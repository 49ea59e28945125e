"""The dashboard of a real federation, read in a real headless Chromium.

One aggregator (`--ui-port`, `--metrics-port`) and three real nodes training digits: one sees
two GPUs through the fake libnvidia-ml.so.1, one runs `--gpu none`, one offers a GPU on a host
without NVML. The page is opened with the operator token through its login form; what it
shows is compared with the Admin service's documents. The same run answers the JSON, `fedgpu ui`
and the Grafana dashboard's metric names.

FEDGPU_DASHBOARD_SCREENSHOT=docs/dashboard.png also writes the screenshot there (docs/reference and
the README show it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.browser import new_driver, wait_for
from tests.fixtures.fake_nvml import FakeNvml, fake_uuid, write_inventory
from tests.fixtures.federation import ROOT, Federation, cli, free_port, write_job

TWO_GPUS = [{"name": "NVIDIA L4", "memory_total_mib": 23034, "memory_used_mib": 4100},
            {"name": "NVIDIA L4", "memory_total_mib": 23034, "memory_used_mib": 700}]
SITES = ("site-two-gpus", "site-cpu-only", "site-no-nvml")


@dataclass
class UiRun:
    fed: Federation
    url: str
    ui_port: int
    metrics_port: int
    tmp: Path

    def get(self, path: str, token: str | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url.rstrip("/") + path)
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


@pytest.fixture(scope="module")
def ui_run(tmp_path_factory: pytest.TempPathFactory, digits_split: list[Path],
           fake_nvml_lib: Path) -> Iterator[UiRun]:
    tmp = tmp_path_factory.mktemp("dashboard-run")
    nvml = FakeNvml(fake_nvml_lib, tmp)
    two = write_inventory(tmp / "two-gpus.conf", TWO_GPUS)
    fed = Federation(tmp)
    ui_port, metrics_port = free_port(), free_port()
    try:
        fed.start_server(write_job(tmp / "job.toml", rounds=2, min_nodes=3, use_gpu=True),
                         "--heartbeat-s", "1", "--ui-port", str(ui_port), "--metrics-port",
                         str(metrics_port))
        extra = {"FEDGPU_SIMULATED_GPUS": "1", "FEDGPU_TOKEN": fed.token,
                 "PYTHONUNBUFFERED": "1"}
        env_two = nvml.env(extra)
        env_two["FAKE_NVML_CONFIG"] = str(two)
        fed.start_node(SITES[0], digits_split[0], "--gpu", "offer", env=env_two)
        fed.start_node(SITES[1], digits_split[1], "--gpu", "none",
                       env=nvml.env_without_library(extra))
        fed.start_node(SITES[2], digits_split[2], "--gpu", "offer",
                       env=nvml.env_without_library(extra))
        yield UiRun(fed, f"http://127.0.0.1:{ui_port}/", ui_port, metrics_port, tmp)
    finally:
        fed.stop()


@pytest.fixture(scope="module")
def finished(ui_run: UiRun) -> UiRun:
    assert ui_run.fed.wait_state(("finished", "failed"))["state"] == "finished"
    return ui_run


def _page_state(driver: Any) -> dict[str, Any]:
    """Everything the assertions read, in one script: one consistent render."""
    return driver.execute_script("""
      const rows = [...document.querySelectorAll('#sites-table tbody tr')].map((tr) => ({
        node: tr.dataset.node,
        cells: [...tr.cells].map((td) => td.innerText),
        device: tr.querySelector('td.decision .device').textContent,
        reason: tr.querySelector('td.decision .reason').textContent,
        warnings: [...tr.querySelectorAll('td.decision .warnings li')].map((li) => li.textContent),
        spark: Object.fromEntries([...tr.querySelectorAll('svg.spark g.series')].map((g) =>
          [g.dataset.series, [...g.querySelectorAll('circle.point')].map((c) =>
            [Number(c.dataset.x), Number(c.dataset.y)])])),
      }));
      const acc = [...document.querySelectorAll('#chart-accuracy g.series.accuracy circle.point')]
        .map((c) => [Number(c.dataset.x), Number(c.dataset.y)]);
      return {rows, acc, state: document.getElementById('run-state').textContent,
              round: document.getElementById('ov-round').textContent,
              sites: document.getElementById('sites-range').textContent,
              rounds: [...document.querySelectorAll('#rounds-table tbody tr')]
                .map((tr) => tr.dataset.round),
              dash: window.fedgpuDash};
    """)


def test_the_page_shows_sites_gpus_and_rounds(ui_run: UiRun, tmp_path: Path) -> None:
    driver = new_driver(tmp_path)
    try:
        driver.get(ui_run.url)
        # Not logged in: the login form, and no data on the page.
        wait_for(lambda: driver.current_url.endswith("/login"), 20, "the login form")
        assert "site-" not in driver.page_source
        driver.find_element("id", "token").send_keys(ui_run.fed.operator_token)
        driver.find_element("css selector", "#login-form button").click()
        wait_for(lambda: driver.execute_script(
            "return window.fedgpuDash && window.fedgpuDash.refreshes"), 30, "the first refresh")
        # The page polls by itself: round 2 done and evaluated, the run finished.
        state = wait_for(lambda: (s := _page_state(driver))["state"] == "finished"
                         and len(s["acc"]) == 2 and s, 300, "round 2 on the page")

        nodes = {n["name"]: n for n in ui_run.fed.query("ListNodes")["nodes"]}
        rounds = ui_run.fed.query("ListRounds")
        assert sorted(nodes) == sorted(SITES)
        assert state["round"] == "2 / 2" and state["sites"] == "1–3 of 3"
        rows = {r["node"]: r for r in state["rows"]}
        assert sorted(rows) == sorted(SITES)
        for name, row in rows.items():
            decision = nodes[name]["gpu_decision"]
            assert row["device"] == decision["device"], name
            assert row["reason"] == decision["reason"], name
            assert row["warnings"] == decision["warnings"], name

        two = rows["site-two-gpus"]
        assert two["device"] == "cuda"
        # The GPU with the most free memory (index 1), named with its UUID and the host's count.
        gpu_cell = two["cells"][3]
        assert "NVIDIA L4" in gpu_cell and fake_uuid(1) in gpu_cell
        assert "2 GPUs on host" in gpu_cell
        assert "700 MiB / 23034 MiB" in two["cells"][5]
        # One point per round in each NVML series: before, peak, after.
        assert set(two["spark"]) == {"before", "peak", "after"}
        for points in two["spark"].values():
            assert points == [[1, 700], [2, 700]]
        assert rows["site-cpu-only"]["device"] == "cpu"
        assert "--gpu none" in rows["site-cpu-only"]["cells"][4]
        assert rows["site-no-nvml"]["device"] == "cpu"
        assert "no GPU" in rows["site-no-nvml"]["cells"][3]
        # CPU sites: the training process's peak RSS per round instead.
        assert [p[0] for p in rows["site-cpu-only"]["spark"]["RSS peak"]] == [1, 2]

        # The accuracy chart: one point per finished round, at the Admin service's values.
        expected = [[r["round"], r["eval"]["accuracy"]] for r in rounds["rounds"]
                    if r["status"] == "finished"]
        assert len(expected) == 2
        assert [p[0] for p in state["acc"]] == [p[0] for p in expected]
        for (_, shown), (_, want) in zip(state["acc"], expected, strict=True):
            assert shown == pytest.approx(want)
        assert state["rounds"] == ["2", "1"]
        # Without the credential the browser gets 401 and no data.
        status, body = driver.execute_async_script("""
          const done = arguments[arguments.length - 1];
          fetch('/api/nodes', {credentials: 'omit'})
            .then(async (r) => done([r.status, await r.text()]));
        """)
        assert status == 401 and "site-" not in body
        assert state["dash"]["error"] is None

        # The whole page in one picture: a window as tall as the document.
        height = min(4000, driver.execute_script(
            "return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)"))
        frame = driver.execute_script("return window.outerHeight - window.innerHeight")
        driver.set_window_size(1440, height + frame + 20)
        wait_for(lambda: driver.execute_script("return window.innerHeight") >= height, 10,
                 "the window to grow to the page's height")
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        if os.environ.get("FEDGPU_DASHBOARD_SCREENSHOT"):
            shutil.copyfile(shot, ROOT / os.environ["FEDGPU_DASHBOARD_SCREENSHOT"])
    finally:
        driver.quit()


def _volatile(doc: Any) -> Any:
    # Ages and countdowns move between two requests; everything else must be equal.
    if isinstance(doc, dict):
        return {k: _volatile(v) for k, v in doc.items()
                if k not in ("last_seen_s", "last_seen_at", "uptime_s", "deadline_in_s", "alive",
                             "state")}
    if isinstance(doc, list):
        return [_volatile(v) for v in doc]
    return doc


@pytest.mark.parametrize(("path", "command"), [
    ("/api/status", "status"), ("/api/nodes", "nodes"), ("/api/rounds", "rounds")])
def test_api_documents_are_the_clis(finished: UiRun, path: str, command: str) -> None:
    r = cli(command, "--address", finished.fed.address, "--json")
    assert r.returncode == 0, r.stderr
    status, body = finished.get(path, token=finished.fed.operator_token)
    assert status == 200
    assert _volatile(json.loads(body)) == _volatile(json.loads(r.stdout))
    assert finished.get(path)[0] == 401
    assert finished.get(path, token="not-the-token")[0] == 401


def test_api_jobs_is_the_job_list(finished: UiRun) -> None:
    r = cli("job", "list", "--address", finished.fed.address, "--json")
    assert r.returncode == 0, r.stderr
    status, body = finished.get("/api/jobs", token=finished.fed.operator_token)
    assert status == 200
    (job,) = json.loads(body)
    assert job == json.loads(r.stdout)[0] and job["state"] == "finished"
    assert finished.get("/api/jobs", token=finished.fed.token)[0] == 401


def test_fedgpu_ui_prints_the_url(finished: UiRun) -> None:
    r = cli("ui", "--ui-port", str(finished.ui_port), "--no-open", token=None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == finished.url
    closed = free_port()
    r = cli("ui", "--ui-port", str(closed), "--no-open", token=None)
    assert r.returncode == 1
    assert r.stdout.strip() == f"http://127.0.0.1:{closed}/"
    assert "no dashboard answers" in r.stderr and f"ssh -L {closed}:127.0.0.1:{closed}" in r.stderr


def _metric_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def _queried(dashboard: dict[str, Any]) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert exprs
    return {m for e in exprs for m in re.findall(r"\b((?:fedgpu|process)_[a-z_]+)\b", e)}


def test_grafana_dashboard_queries_only_metrics_the_aggregator_serves(finished: UiRun) -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "fedgpu.json").read_text())
    with urllib.request.urlopen(f"http://127.0.0.1:{finished.metrics_port}/metrics",
                                timeout=20) as r:
        served = _metric_names(r.read().decode())
    queried = _queried(dashboard)
    # Every metric a panel queries is served, and every fedgpu metric served is on a panel.
    assert queried <= served, sorted(queried - served)
    ours = {n for n in served if n.startswith("fedgpu_")}
    assert len(ours) >= 20 and ours <= queried, sorted(ours - queried)
    assert {"fedgpu_node_gpu_memory_used_mib", "fedgpu_eval_accuracy",
            "fedgpu_updates_rejected_total"} <= queried
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"]
               if p["type"] != "row")
