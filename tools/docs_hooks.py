"""MkDocs hooks (mkdocs.yml `hooks:`): the generated parts of the docs site.

A page asks for a generated part with a marker line, e.g. `<!-- generated: cli -->`; the build
replaces the marker with the text read from the code at that moment (tools/cli_reference.py,
tools/job_keys.py). Nothing generated is committed, so nothing generated can be stale.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# MkDocs loads this file by path, not as part of a package, and puts its folder on sys.path
# only while loading it: the generators beside it are imported now, from this folder.
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import cli_reference  # noqa: E402
import job_keys  # noqa: E402

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.M)


def _generators() -> dict[str, Callable[[], str]]:
    return {"cli": cli_reference.markdown, "job-keys": job_keys.markdown,
            "strategies": job_keys.strategies}


def expand(markdown: str) -> str:
    """The page with every marker replaced by its generated text; an unknown name fails."""
    generators = _generators()

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in generators:
            raise ValueError(f"unknown generated part {name!r}: one of {sorted(generators)}")
        return generators[name]()

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return expand(markdown)
