"""docs/how-to/statistics.md runs as written (tests/fixtures/doc_blocks.py): a statistics job
through `fedgpu run`, with its table of figures in the run's summary."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.doc_blocks import ROOT, run_page


def test_statistics_howto_runs_as_written(tmp_path: Path) -> None:
    results = run_page(ROOT / "docs" / "how-to" / "statistics.md", tmp_path)
    out = results[-1].output
    # The combined line of each column, and no model or training in the summary.
    assert any(line.startswith("label") and "combined" in line for line in out.splitlines()), out
    assert "final global model" not in out and "run finished: 1 round" in out, out
