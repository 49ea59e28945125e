"""Run import-linter's contracts (pyproject.toml) on the layout fedgpu installs as.

node/ and server/ install as fedgpu.node and fedgpu.server (a setuptools package-dir
mapping). import-linter finds a package's modules by walking its directory, so in the
repository it cannot see them under fedgpu/. This stages the installed layout (links to the
sources, following pyproject's packages and package-dir) in a temporary directory and runs
`lint-imports` there. `--root DIR` lints another checkout (the tests use a copy with a bad
import added).

    python tools/lint_layers.py [--root DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path


def stage(root: Path, dest: Path) -> None:
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = cfg.get("package-dir", {})
    for package in cfg["packages"]:
        # The longest mapped prefix decides where a package's sources are.
        prefix = max((p for p in mapping if package == p or package.startswith(p + ".")),
                     key=len, default=None)
        if prefix is None:
            src = root / package.replace(".", "/")
        else:
            rest = package[len(prefix):].lstrip(".")
            src = root / mapping[prefix] / rest.replace(".", "/")
        out = dest / package.replace(".", "/")
        out.mkdir(parents=True, exist_ok=True)
        for module in src.glob("*.py"):
            os.symlink(module.resolve(), out / module.name)
    shutil.copy(root / "pyproject.toml", dest / "pyproject.toml")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    exe = Path(sys.executable).with_name("lint-imports")
    with tempfile.TemporaryDirectory(prefix="fedgpu-layers-") as tmp:
        stage(args.root.resolve(), Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}
        return subprocess.call([str(exe), "--config", "pyproject.toml", "--no-cache"],
                               cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main())
