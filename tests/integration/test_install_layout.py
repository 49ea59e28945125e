"""Installed, fedgpu is one import package: `fedgpu`, with fedgpu.node and fedgpu.server
inside it, and no top-level `node` or `server` to clash with other distributions.

The wheel is built from this checkout (no build isolation: the venv's setuptools) and
installed without dependencies into a directory of its own; a fresh interpreter started
outside the repository imports from there.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.fixtures.federation import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # The build writes build/ and *.egg-info next to the sources; both are git-ignored.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    (found,) = out.glob("fedgpu-*.whl")
    return found


@pytest.fixture(scope="module")
def target(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(dest), str(wheel)], check=True, capture_output=True, timeout=300)
    return dest


def _python(target: Path, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # -I: no PYTHONPATH, no user site, no script directory; the installed copy comes first.
    return subprocess.run([sys.executable, "-I", "-c",
                           f"import sys; sys.path.insert(0, {str(target)!r}); {code}"],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def test_the_wheel_has_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        paths = [line.split(",")[0] for line in zf.read(record).decode().splitlines()]
        top_level = next(n for n in zf.namelist() if n.endswith(".dist-info/top_level.txt"))
        assert zf.read(top_level).decode().split() == ["fedgpu"]
    tops = {p.split("/")[0] for p in paths if not p.split("/")[0].endswith(".dist-info")}
    assert tops == {"fedgpu"}, tops
    assert "fedgpu/node/nvml.py" in paths and "fedgpu/server/strategies/aggregate.py" in paths
    assert "fedgpu/node/tasks/digits.py" in paths
    assert "fedgpu/server/strategies/fedavg.py" in paths
    assert "fedgpu/proto/fedgpu/v1/federation.proto" in paths


def test_every_package_directory_is_in_the_wheel(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    for init in [*ROOT.glob("fedgpu/**/__init__.py"), *ROOT.glob("node/**/__init__.py"),
                 *ROOT.glob("server/**/__init__.py")]:
        rel = init.relative_to(ROOT).as_posix()
        installed = rel if rel.startswith("fedgpu/") else f"fedgpu/{rel}"
        assert installed in names, f"{rel} is not packaged: add it to pyproject's packages"


@pytest.mark.parametrize("name", ["node", "server"])
def test_no_top_level_node_or_server(target: Path, tmp_path: Path, name: str) -> None:
    r = _python(target, f"import {name}", tmp_path)
    assert r.returncode != 0
    assert f"ModuleNotFoundError: No module named '{name}'" in r.stderr


def test_the_installed_packages_import(target: Path, tmp_path: Path) -> None:
    r = _python(target, "import fedgpu.node.nvml, fedgpu.server.strategies.aggregate, "
                "fedgpu.cli.app; "
                "print(fedgpu.node.nvml.__file__)", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(target))


def test_the_dashboard_assets_are_in_the_wheel(wheel: Path, target: Path, tmp_path: Path
                                               ) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assets = sorted(p.name for p in (ROOT / "server" / "views" / "ui").iterdir()
                    if p.suffix in (".html", ".js", ".css"))
    assert {"index.html", "login.html", "app.js", "charts.js", "style.css"} <= set(assets)
    for name in assets:
        assert f"fedgpu/server/views/ui/{name}" in names, f"server/views/ui/{name} is not packaged"
    # The installed server reads every asset from its own package directory.
    r = _python(target, "import fedgpu.server.views.dashboard as d; s = d.DashboardServer("
                "d.DashboardSources(status=dict, nodes=dict, rounds=dict, is_operator=bool)); "
                "print(d.__file__); print(' '.join(sorted(s.assets)))", tmp_path)
    assert r.returncode == 0, r.stderr
    where, loaded = r.stdout.splitlines()
    assert where.startswith(str(target))
    assert loaded.split() == assets
