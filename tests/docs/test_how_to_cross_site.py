"""docs/how-to/cross-site-evaluation.md runs as written: an aggregator and two sites on
loopback (one shares its local model, one has no policy), a one-round training job and the
cross-site job; the matrix as `job status` prints it; then `fedgpu run --cross-site`.
tests/integration/test_cross_site_mode.py checks the numbers."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tests.fixtures.doc_blocks import ROOT, run_page

PAGE = ROOT / "docs" / "how-to" / "cross-site-evaluation.md"


@pytest.mark.slow  # two training jobs and two cross-site jobs: ~90 s on 2 idle cores
def test_the_cross_site_how_to_runs_as_written(tmp_path: Path) -> None:
    port = int(re.search(r"--port (\d+)", PAGE.read_text()).group(1))
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            pytest.skip(f"127.0.0.1:{port} is taken: the how-to starts its aggregator there")
    results = run_page(PAGE, tmp_path)
    out, local = results[-2].output, results[-1].output
    # The table (fedgpu/cli/common/cross_site_text.py): the global model and site-a's local
    # model scored on both sites; site-b's model stayed home, and the note says why.
    assert re.search(r"global\s+0\.\d{4}\s+0\.\d{4}\s+0\.\d{4}", out), out
    assert re.search(r"site-a \(local\)\s+0\.\d{4}\s+0\.\d{4}", out), out
    assert "site-b (local): not scored: site policy: none set" in out, out
    # fedgpu run --cross-site: its nodes share their local models, so every row has scores.
    rows = [re.search(rf"{node} \(local\)\s+(0\.\d{{4}}\s+0\.\d{{4}})", local)
            for node in ("node-1", "node-2")]
    assert all(rows), local
    # Two models trained on different data: not the same scores (each its own round).
    assert rows[0].group(1) != rows[1].group(1), local
    assert "run finished" in local, local
