"""Fixtures for the container tests: an engine or a clean skip, images built once per
session, and compose projects that are always taken down.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from .dockerutil import (
    BUILD_SCRIPT,
    NODE_IMAGE,
    SERVER_IMAGE,
    ComposeProject,
    engine_available,
    free_port,
    run,
)


@pytest.fixture(scope="session")
def docker_engine() -> None:
    reason = engine_available()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def built_images(docker_engine: None) -> dict[str, str]:
    """Builds both images from the Dockerfiles as shipped, with build args only.

    FEDGPU_E2E_BUILD=offline (default: local Debian base + wheelhouse, what machines
    without a registry need), online (the Dockerfiles' registry defaults) or skip (use
    the images already tagged FEDGPU_E2E_SERVER_IMAGE / FEDGPU_E2E_NODE_IMAGE).
    """
    mode = os.environ.get("FEDGPU_E2E_BUILD", "offline")
    if mode != "skip":
        args = ["bash", str(BUILD_SCRIPT)]
        if mode == "offline":
            args.append("--offline")
        elif mode != "online":
            raise pytest.UsageError(f"FEDGPU_E2E_BUILD={mode!r}: offline, online or skip")
        env = {**os.environ, "FEDGPU_SERVER_IMAGE": SERVER_IMAGE, "FEDGPU_NODE_IMAGE": NODE_IMAGE}
        # The slow part of e2e on a cold machine; the engine's layer cache makes reruns quick.
        proc = run(args, env=env, timeout=1500)
        # Step timings (shown with -rA, or on failure).
        print("\n".join(line for line in proc.stderr.splitlines() if line.startswith("[build")))
    for image in (SERVER_IMAGE, NODE_IMAGE):
        run(["docker", "image", "inspect", image])
    return {"server": SERVER_IMAGE, "node": NODE_IMAGE}


@pytest.fixture
def compose_project(built_images: dict[str, str]) -> Iterator[Any]:
    """Factory of compose projects; every one is taken down (with its volumes) after the
    test, whether it passed or not, and its logs are printed (pytest shows them on failure).
    """
    projects: list[ComposeProject] = []

    def make(files: Sequence[Path] = ()) -> ComposeProject:
        project = ComposeProject(built_images, free_port(), files)
        projects.append(project)
        return project

    yield make
    for project in projects:
        try:
            print(f"===== logs of {project.name} =====")
            print(project.logs()[-20000:])
        finally:
            project.down()
