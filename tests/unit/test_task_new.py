"""`fedgpu task new` writes the task and, beside it, a job file that names it (never over an
existing one)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from typer.testing import CliRunner

from fedgpu.cli.app import app
from fedgpu.core.job import parse_job


def test_task_new_writes_a_job_file_beside_the_task(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["task", "new", "demo", "--dir", str(tmp_path / "demo")])
    assert r.exit_code == 0, r.output
    job = tmp_path / "job.toml"
    raw = tomllib.loads(job.read_text())
    assert raw["task_dir"] == "demo" and parse_job(raw).task == "demo"
    assert str(job) in r.output
    # A second task in the same folder keeps the first job file and gets its own.
    r = CliRunner().invoke(app, ["task", "new", "other", "--dir", str(tmp_path / "other")])
    assert r.exit_code == 0, r.output
    assert tomllib.loads(job.read_text())["task_dir"] == "demo"
    assert tomllib.loads((tmp_path / "other-job.toml").read_text())["task_dir"] == "other"
