"""Tables for people: whole words at 80 columns (a pipe), one record per block when too wide."""

from __future__ import annotations

import io

from rich.console import Console

from fedgpu.cli.common.output import new_table, print_table


def _render(table, width: int = 80) -> str:
    out = io.StringIO()
    print_table(table, Console(file=out, width=width, force_terminal=False))
    return out.getvalue()


def test_a_table_that_fits_prints_as_a_table() -> None:
    table = new_table("id", "state")
    table.add_row("4f2a", "running")
    text = _render(table)
    assert "id" in text.splitlines()[0] and "state" in text.splitlines()[0]
    assert "running" in text and "state:" not in text


def test_a_table_too_wide_prints_one_record_per_block_without_cutting_words() -> None:
    table = new_table("id", "name", "state", "submitted", "task", "strategy", "detail", ids=1)
    for i in range(2):
        table.add_row(f"abcdef12345{i}", "a-long-job-name-for-people", "submitted",
                      "2026-11-26 18:40:00", "causal-lm", "trimmed_mean",
                      "waiting for 3 sites of study onco: 2 busy with job 4f2a")
    text = _render(table)
    assert "submitted:" in text and "detail:" in text
    # Every value is whole on its line: no "submitt" / "ed" folding.
    assert "state:     submitted" in text
    assert "waiting for 3 sites of study onco: 2 busy with job 4f2a" in text
    assert text.count("id:") == 2
