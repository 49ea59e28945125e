"""`runs/latest`: the newest run directory of `fedgpu run`, so a command written once
(`fedgpu report --rounds-json runs/latest/rounds.json`) works after any number of runs."""

from __future__ import annotations

import os
from pathlib import Path

LATEST = "latest"


def link_latest(run_dir: Path) -> None:
    """Point `latest` beside `run_dir` at it. Replaced atomically (a new link renamed over
    the old), so a reader never finds it missing; a file system without links just has none."""
    link = run_dir.parent / LATEST
    tmp = run_dir.parent / f".{LATEST}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)
