"""What people read carries no Python literals: no `None`, `True` or `False` where a value is
missing or a setting is on or off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedgpu.cli.app import app
from fedgpu.cli.status import show_status

LITERAL = re.compile(r"\b(None|True|False)\b")

# `fedgpu status --json` of an aggregator that never ran a job (server/views/documents.py).
IDLE = {"run_id": None, "job_id": None, "state": "idle", "error": None, "task": None,
        "mode": None, "strategy": None, "round": 0, "rounds": 0, "current_round": None,
        "nodes": {"registered": 0, "alive": 0}, "accuracy": None, "loss": None,
        "rejections": {}, "uploads": None, "bulk": None, "started_at": None,
        "finished_at": None, "uptime_s": 0.0, "job": None, "dashboard": None,
        "version": "test"}


def test_status_without_a_run_says_dash(capsys: pytest.CaptureFixture[str]) -> None:
    show_status(IDLE)
    out = capsys.readouterr().out
    assert not LITERAL.search(out), out
    assert out.splitlines()[0] == "job -  run -  state idle  task -  strategy -"


def test_connection_show_says_whether_a_token_is_set(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDGPU_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("FEDGPU_OPERATOR_TOKEN", raising=False)
    runner = CliRunner()
    r = runner.invoke(app, ["connection", "add", "prod", "--address", "prod:50051",
                            "--token-stdin"], input="secret\n")
    assert r.exit_code == 0, r.output
    shown = runner.invoke(app, ["connection", "show", "--connection", "prod"]).output
    assert re.search(r"^token\s+set$", shown, re.M) and not LITERAL.search(shown), shown
    shown = runner.invoke(app, ["connection", "show", "--address", "other:50051"]).output
    assert re.search(r"^token\s+not set$", shown, re.M) and not LITERAL.search(shown), shown
