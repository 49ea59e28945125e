"""Tables for people fit an 80-column terminal and show ids at 12 characters, enough to give
back to the commands that take them."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from fedgpu.cli.app import app


def _run(*args: str) -> str:
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "80"})
    assert r.exit_code == 0, (r.output, r.exception)
    return r.output


def test_node_tasks_fits_80_columns_and_its_short_hash_approves(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _run("task", "new", "a-task-with-a-rather-long-name", "--dir", str(tmp_path / "t"))
    _run("node", "reject", str(tmp_path / "t"), "--state-dir", str(state))
    sha = json.loads(_run("node", "tasks", "--state-dir", str(state), "--json"))[0]["sha256"]
    table = _run("node", "tasks", "--state-dir", str(state))
    assert max(len(line) for line in table.splitlines()) <= 80, table
    assert sha[:12] in table and sha not in table
    # What the table shows is enough to decide on it.
    out = _run("node", "approve", sha[:12], "--state-dir", str(state), "--json")
    assert json.loads(out)["state"] == "approved"
