"""The built images: what they carry and how they are configured.

Needs a Docker engine (skips with the reason without one); the images are built once per
session from the Dockerfiles as shipped (see the built_images fixture).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from .dockerutil import run

pytestmark = pytest.mark.e2e


def inspect(image: str) -> dict[str, Any]:
    return json.loads(run(["docker", "image", "inspect", image]).stdout)[0]["Config"]


def in_image(image: str, *cmd: str, check: bool = False):
    return run(["docker", "run", "--rm", "--entrypoint", cmd[0], image, *cmd[1:]], check=check)


def test_server_image_has_no_torch(built_images: dict[str, str]) -> None:
    proc = in_image(built_images["server"], "python", "-c", "import torch")
    assert proc.returncode != 0
    assert "No module named 'torch'" in proc.stderr


def test_node_image_has_torch_and_nvml(built_images: dict[str, str]) -> None:
    proc = in_image(
        built_images["node"], "python", "-c", "import torch, pynvml, sklearn; print('ok')"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("which", ["server", "node"])
def test_runtime_is_non_root_without_compilers(built_images: dict[str, str], which: str) -> None:
    image = built_images[which]
    config = inspect(image)
    assert config["User"] == "10001:10001"
    proc = in_image(image, "sh", "-c", "id -u; command -v gcc cc c++ || echo none")
    assert proc.stdout.split() == ["10001", "none"], proc.stdout


@pytest.mark.parametrize("which", ["server", "node"])
def test_cli_runs_in_image(built_images: dict[str, str], which: str) -> None:
    proc = run(["docker", "run", "--rm", built_images[which], "--help"], check=False)
    assert proc.returncode == 0, proc.stderr
    assert "server" in proc.stdout and "node" in proc.stdout


def test_server_image_config(built_images: dict[str, str]) -> None:
    config = inspect(built_images["server"])
    assert "50051/tcp" in config["ExposedPorts"]
    assert "/var/lib/fedgpu" in config["Volumes"]
    assert "fedgpu health" in " ".join(config["Healthcheck"]["Test"])
    assert config["Entrypoint"] == ["fedgpu"]
    assert config["Cmd"][:2] == ["server", "start"]


def test_node_image_config(built_images: dict[str, str]) -> None:
    config = inspect(built_images["node"])
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["FEDGPU_GPU"] == "offer"
    assert config["Healthcheck"]["Test"] == ["CMD", "fedgpu", "node", "health"]
    assert config["Cmd"] == ["node", "start"]
