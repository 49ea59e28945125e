"""docs/how-to/evaluate-a-model.md runs as written: an aggregator and two sites on loopback, a
short training job, its final model scored by job id and as an uploaded file (`job submit`
and `fedgpu run`). tests/integration/test_evaluate_mode.py checks the numbers."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tests.fixtures.doc_blocks import ROOT, run_page

PAGE = ROOT / "docs" / "how-to" / "evaluate-a-model.md"


@pytest.mark.slow  # a training job, three evaluate jobs and a local run: ~60 s on 2 idle cores
def test_the_evaluate_how_to_runs_as_written(tmp_path: Path) -> None:
    port = int(re.search(r"--port (\d+)", PAGE.read_text()).group(1))
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            pytest.skip(f"127.0.0.1:{port} is taken: the how-to starts its aggregator there")
    results = run_page(PAGE, tmp_path)
    by_id, by_file, local = results[3], results[4], results[5]
    for r in (by_id, by_file):
        # Each site's line, then the weighted one (fedgpu/cli/common/evaluation.py).
        assert re.search(r"site-a: accuracy 0\.\d{4}, loss \d+\.\d{4} on \d+ examples",
                         r.output), r.output
        assert "site-b: accuracy" in r.output
    # The same model on the same sites' data: the same weighted accuracy both ways.
    weighted = [re.search(r"weighted by examples: accuracy (\S+),", r.output).group(1)
                for r in (by_id, by_file)]
    assert weighted[0] == weighted[1], weighted
    assert "node-1: accuracy" in local.output and "run finished" in local.output, local.output
