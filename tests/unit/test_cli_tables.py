"""Tables for people fit an 80-column terminal and show ids at 12 characters, enough to give
back to the commands that take them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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


def test_the_nodes_table_fits_80_columns(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from fedgpu.cli.nodes import show_nodes

    monkeypatch.setenv("COLUMNS", "80")
    show_nodes({"nodes": [
        {"name": "node-gpu-offered-1", "state": "alive", "rounds_completed": 12,
         "gpu_decision": {"device": "cuda:0", "gpu_name": "NVIDIA H100 80GB HBM3",
                          "reason": "most free memory (81000 MiB)"},
         "last_resources": {"device": "cuda", "nvml_used_before_mib": 512,
                            "nvml_used_peak_mib": 2048, "nvml_used_after_mib": 512},
         "transport": "bulk"},
        {"name": "node-cpu-1", "state": "lost", "rounds_completed": 3,
         "gpu_decision": {"device": "cpu", "reason": "--gpu none"},
         "last_resources": {"device": "cpu", "rss_peak_mib": 812.5},
         "transport": "grpc", "bulk_error": "connection refused"}]})
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert "node-gpu-offered-1" in out and "512/2048/512" in out
    assert "node-cpu-1: bulk port unreachable (connection refused)" in out
