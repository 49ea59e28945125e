"""`fedgpu job submit --watch`: a clear usage error with --json, before anything is sent.
(The watch itself runs in the e2e suite: docs/tutorials/compose.md submits the secure example
job with --watch and expects it to finish.)"""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from fedgpu.cli.app import app

ROOT = Path(__file__).resolve().parents[2]


def test_watch_with_json_is_refused_before_anything_is_sent() -> None:
    # Port 1: were the job sent, the error would be "cannot reach" with exit code 1.
    r = CliRunner().invoke(app, ["job", "submit", str(ROOT / "compose" / "job.toml"),
                                 "--watch", "--json", "--address", "127.0.0.1:1",
                                 "--insecure"], env={"COLUMNS": "200"})
    assert r.exit_code == 2, r.output
    assert "fedgpu status --watch --json --job ID" in r.output
