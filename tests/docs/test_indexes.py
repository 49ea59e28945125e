"""Each section's index page lists every page of its section: a reader who opens 'How-to
guides' sees every guide (five were missing once), and contributor pages live apart."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
SECTIONS = ["tutorials", "how-to", "reference", "explanation", "contributing"]


@pytest.mark.parametrize("section", SECTIONS)
def test_every_page_of_a_section_is_on_its_index(section: str) -> None:
    folder = DOCS / section
    index = (folder / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]+)?\)", index))
    pages = {p.name for p in folder.glob("*.md")} - {"index.md"}
    assert pages, f"docs/{section} has no pages"
    assert not pages - linked, f"docs/{section}/index.md misses {sorted(pages - linked)}"


def test_contributor_pages_are_not_how_to_guides() -> None:
    how_to = {p.name for p in (DOCS / "how-to").glob("*.md")}
    assert not {"development.md", "contributing-tests.md"} & how_to
