"""The docs' table of environment variables (docs/reference/environment.md) is the CLI's:
generated from the real typer app."""

from __future__ import annotations

import subprocess
import sys

from tools import env_table


def test_docs_table_matches_the_cli() -> None:
    in_page = env_table.in_page(env_table.PAGE.read_text())
    assert in_page is not None, f"{env_table.PAGE} lost its env-table markers"
    assert in_page == env_table.block(), (
        "docs/reference/environment.md's environment variables differ from the CLI's options: "
        "run 'python tools/env_table.py --write' and commit the page")


def test_table_reads_the_options_themselves() -> None:
    rows = env_table.rows()
    assert ("fedgpu node start", "--aggregator", "`FEDGPU_AGGREGATOR`") in rows
    assert ("fedgpu server start", "--token", "`FEDGPU_TOKEN`") in rows
    # Flags without a variable are not claimed to read one.
    assert not [r for r in rows if r[1] in ("--host", "--insecure", "--chunk-size")]
    # Each variable the table names is honoured by that command: FEDGPU_DATA alone supplies
    # the required --data of `node start` (it then fails later, on the missing directory).
    env = {"PATH": "/usr/bin:/bin", "FEDGPU_AGGREGATOR": "127.0.0.1:1",
           "FEDGPU_DATA": "/nonexistent/fedgpu-data", "FEDGPU_TOKEN": "t"}
    r = subprocess.run([sys.executable, "-m", "fedgpu.cli.app", "node", "start"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "/nonexistent/fedgpu-data" in r.stderr, r.stderr
