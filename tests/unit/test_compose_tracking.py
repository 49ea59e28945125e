"""MLflow tracking on the compose aggregator, as the files say it (no engine needed; the
deployment itself: tests/e2e/test_compose_modes.py): the aggregator image installs the
`tracking` extra by default, compose passes FEDGPU_TRACKING_URI through (empty: off), and
compose/tracking.yaml points the URI inside the host directory it mounts."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_the_aggregator_image_installs_the_tracking_extra_by_default() -> None:
    dockerfile = (ROOT / "images" / "server.Dockerfile").read_text()
    default = re.search(r"^ARG SERVER_EXTRAS=(.*)$", dockerfile, re.M)
    assert default is not None and "tracking" in default.group(1).split(",")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(r.startswith("mlflow") for r in extras["tracking"])
    # The offline wheelhouse must hold what the image installs.
    assert 'extras["tracking"]' in (ROOT / "images" / "build.sh").read_text()


def test_compose_passes_the_uri_and_the_override_stores_runs_in_its_mount() -> None:
    base = yaml.safe_load((ROOT / "compose" / "compose.yaml").read_text())
    env = base["services"]["aggregator"]["environment"]
    assert env["FEDGPU_TRACKING_URI"] == "${FEDGPU_TRACKING_URI:-}"
    override = yaml.safe_load((ROOT / "compose" / "tracking.yaml").read_text())
    aggregator = override["services"]["aggregator"]
    uri = re.fullmatch(r"\$\{FEDGPU_TRACKING_URI:-file:(/.+)\}",
                       aggregator["environment"]["FEDGPU_TRACKING_URI"])
    assert uri is not None
    (mount,) = aggregator["volumes"]
    target = mount.split(":")[-1]
    assert uri.group(1).startswith(target.rstrip("/") + "/"), (uri.group(1), target)
