"""`mode = "statistics"` on a real federation (aggregator and two digits nodes as processes on
loopback): one round, no model; each site's release in `job status --json`, and the combined
figures equal numpy's on the two sites' training data put together; cells under min_count
held back on the site (never in what it sent) and missing from the combination; a bundled
task without a statistics() hook refused with the reason.

Threat model (what the aggregator learns per site; what suppression and noise protect):
docs/explanation/federated-statistics.md.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core.datasets import TRAIN_FILE
from fedgpu.node.data import read_split
from tests.fixtures.federation import Federation, cli, free_port, write_job
from tests.integration.test_jobs import job_cli, wait_job


@pytest.fixture
def site(federation: Federation, tmp_path: Path, digits_split: list[Path]) -> Federation:
    federation.ui_port = free_port()  # type: ignore[attr-defined]
    federation.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1",
                            "--ui-port", str(federation.ui_port))  # type: ignore[attr-defined]
    # Bundles allowed: the second test's task comes as one.
    for name, data in (("site-a", digits_split[0]), ("site-b", digits_split[1])):
        federation.start_node(name, data, "--gpu", "none", "--task-approval", "any")
    return federation


def test_statistics_job_combines_exactly_holds_back_small_cells_and_needs_the_hook(
        site: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    job = write_job(tmp_path / "stats.toml", rounds=None, name="stats", mode="statistics",
                    statistics={"min_count": 30})
    submitted = job_cli(site, "submit", str(job))
    done = wait_job(site, submitted["job_id"], ("finished", "failed", "stopped"))
    assert done["state"] == "finished", done
    assert (done["rounds_done"], done["rounds"]) == (1, 1)
    stats = done["statistics"]  # GetJob: what `fedgpu job status --json` prints
    assert stats["release"] == {"min_count": 30, "noise": "none", "epsilon": 1.0,
                                "delta": 1e-5}
    assert sorted(stats["sites"]) == ["site-a", "site-b"]
    x = [read_split(d, TRAIN_FILE)["x"] for d in digits_split[:2]]
    y = [read_split(d, TRAIN_FILE)["y"] for d in digits_split[:2]]
    pixels = np.concatenate(x).ravel().astype(np.float64)
    labels = np.concatenate(y).astype(np.float64)
    combined = stats["combined"]
    assert combined["pixel"]["count"] == pixels.size
    assert combined["pixel"]["mean"] == pytest.approx(pixels.mean(), rel=1e-9)
    assert combined["pixel"]["std"] == pytest.approx(pixels.std(), rel=1e-9)
    assert combined["label"]["count"] == labels.size
    assert combined["label"]["mean"] == pytest.approx(labels.mean(), rel=1e-9)
    for name, xs, ys in zip(("site-a", "site-b"), x, y, strict=True):
        assert stats["sites"][name]["label"]["mean"] == pytest.approx(ys.mean(), rel=1e-9)
        assert stats["sites"][name]["pixel"]["count"] == xs.size
    # Pixel cells: a cell is held back when it has fewer than 30 images' worth of values (30 x
    # 64); the combined histogram holds only the cells the sites sent.
    threshold = 30 * 64
    hists = [np.histogram(v.ravel().astype(np.float64), bins=16, range=(0, 1))[0] for v in x]
    held = [sum(int(h[i] < threshold) for h in hists) for i in range(16)]
    assert combined["pixel"]["suppressed_cells"] == held
    assert any(held), "the split should leave some small pixel cells"
    # What each site sent, as the aggregator holds it: its small cells are absent (None).
    for name, h in zip(("site-a", "site-b"), hists, strict=True):
        assert stats["sites"][name]["pixel"]["histogram"] == [
            float(c) if c >= threshold else None for c in h]
    for i in range(16):
        sent = [int(h[i]) for h in hists if h[i] >= threshold]
        assert combined["pixel"]["histogram"][i] == (sum(sent) if sent else None)
    # The quantiles come from the merged histogram, within one bin of numpy's.
    assert combined["label"]["bin_width"] == 1.0
    assert abs(combined["label"]["quantiles"]["p50"] - np.quantile(labels, 0.5)) <= 1.0
    human = cli("job", "status", submitted["job_id"], "--address", site.address).stdout
    assert "statistics of 2 site(s) (min_count 30, noise none)" in human, human
    assert any(line.startswith("label") and "combined" in line for line in human.splitlines())
    # The dashboard's Statistics panel reads the same document from /api/status.
    conn = http.client.HTTPConnection("127.0.0.1", site.ui_port, timeout=10)  # type: ignore[attr-defined]
    conn.request("GET", "/api/status", headers={"Authorization": f"Bearer {site.operator_token}"})
    api = json.loads(conn.getresponse().read())
    conn.close()
    assert api["statistics"]["combined"] == combined and api["mode"] == "statistics"

    # On the same federation (a second one would cost its start-up): a bundled task without
    # a statistics() hook is refused by the sites, and the job says why.
    bundle = tmp_path / "nostats"
    bundle.mkdir()
    (bundle / "fedgpu-task.toml").write_text('name = "nostats"\nentry = "nostats:Task"\n')
    (bundle / "nostats.py").write_text(
        "from fedgpu.node.tasks.digits import DigitsTask\n\n\n"
        "class Task(DigitsTask):\n    name = 'nostats'\n    statistics = None\n")
    job = write_job(tmp_path / "nostats.toml", rounds=None, mode="statistics", task=None,
                    task_dir="nostats", round_retries=0)
    submitted = job_cli(site, "submit", str(job))
    done = wait_job(site, submitted["job_id"], ("finished", "failed", "stopped"), timeout=120)
    assert done["state"] == "failed", done
    assert "has no statistics() hook" in (done["error"] or ""), done
