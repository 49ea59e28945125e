"""README.md is the front door: short, the two set-up commands first, a screenshot, where the
docs are; every link in it resolves."""

from __future__ import annotations

import re

from tests.fixtures.doc_blocks import ROOT

README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    assert len(README.splitlines()) <= 200
    first_block = re.search(r"```\w*\n(.*?)```", README, re.S)
    assert first_block is not None
    commands = [ln.split("#")[0].strip() for ln in first_block.group(1).splitlines()]
    assert [c for c in commands if c] == ["make demo", "make test"]
    # Both are real targets of the Makefile.
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert re.search(r"^docs:", makefile, re.M)


def test_readme_links_and_screenshot_resolve() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert "docs/dashboard.png" in links
    assert any(link.startswith("docs/tutorials/") for link in links)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"
