"""A task bundle's `requires` (its manifest's pip-style requirements) against the packages this
Python environment has: the reason a site cannot run a bundle, said before it tries."""

from __future__ import annotations

from collections.abc import Iterable


def unmet_requirements(requires: Iterable[str]) -> list[str]:
    """Each requirement this Python environment does not satisfy, as one line saying why.

    Reads installed distributions' metadata only (importlib.metadata); nothing is imported
    from them and nothing is installed.
    """
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    problems = []
    for spec in requires:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = version(req.name)
        except PackageNotFoundError:
            problems.append(f"{spec}: {req.name} is not installed")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{spec}: {req.name} {have} is installed")
    return problems
