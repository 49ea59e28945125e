"""The compose tutorial (docs/tutorials/compose.md) runs as written on a real Docker engine.

Its blocks run in order in a fresh copy of the checkout (tests/fixtures/doc_blocks.py), with
the images this session built (the built_images fixture: FEDGPU_SERVER_IMAGE / _NODE_IMAGE,
which compose.yaml reads) and, so that it can run beside other projects, a project name and
published ports of its own (COMPOSE_PROJECT_NAME, FEDGPU_PUBLISH_PORT, FEDGPU_BULK_PUBLISH_PORT,
FEDGPU_UI_PUBLISH_PORT; `make up` saves the published port in the connection the admin CLI
then uses, in the page's own HOME). The project is taken down with its volumes afterwards,
whether the page passed or not. Skips, saying why, without an engine.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.fixtures.doc_blocks import ROOT, run_page

from .dockerutil import free_port, run

pytestmark = pytest.mark.e2e


def test_compose_tutorial_runs_as_written(built_images: dict[str, str], tmp_path: Path) -> None:
    name = f"fedgpu-docs-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {
        "COMPOSE_PROJECT_NAME": name,
        "FEDGPU_SERVER_IMAGE": built_images["server"],
        "FEDGPU_NODE_IMAGE": built_images["node"],
        "FEDGPU_PUBLISH_PORT": str(port),
        "FEDGPU_BULK_PUBLISH_PORT": str(free_port()),
        "FEDGPU_UI_PUBLISH_PORT": str(free_port()),
        # A reader's terminal, wide enough for `fedgpu ps`' table.
        "COLUMNS": "200",
    }
    try:
        run_page(ROOT / "docs" / "tutorials" / "compose.md", tmp_path, env)
    finally:
        compose = tmp_path / "checkout" / "compose" / "compose.yaml"
        run(["docker", "compose", "-p", name, "-f", str(compose), "--profile", "cpu", "down",
             "-v", "--remove-orphans"], check=False, timeout=300)
