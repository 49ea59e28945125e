"""pyproject.toml lists fedgpu's packages by hand (a package-dir mapping defeats find()): every
package directory of the source tree must be listed, or the wheel silently lacks it."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _listed() -> tuple[set[str], dict[str, str]]:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(cfg["packages"]), cfg["package-dir"]


def _on_disk(mapping: dict[str, str]) -> set[str]:
    roots = {"fedgpu": REPO / "fedgpu", **{pkg: REPO / d for pkg, d in mapping.items()}}
    found: set[str] = set()
    for pkg, top in roots.items():
        for init in top.rglob("__init__.py"):
            rel = init.parent.relative_to(top)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            found.add(".".join([pkg, *rel.parts]))
    return found


def test_every_package_directory_is_listed_in_pyproject() -> None:
    listed, mapping = _listed()
    missing = _on_disk(mapping) - listed
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_every_listed_package_exists() -> None:
    listed, mapping = _listed()
    stale = listed - _on_disk(mapping)
    assert not stale, f"listed in pyproject.toml but not in the tree: {sorted(stale)}"
