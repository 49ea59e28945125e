"""The dashboard's round view of slow links (issue 37.4): per round, the sites left out or asked
to compress and why; while a round is open, each site's transfer (bytes, rate, time left). Bounded
like the rest of /api/rounds: at most LINK_SITES sites listed, the rest counted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LINK_SITES = 50


def link_summary(rec: Mapping[str, Any]) -> dict[str, Any] | None:
    """A round record's `link`, without its per-site rates; None when it has none."""
    link = rec.get("link")
    if not link:
        return None
    skipped = list(link.get("skipped") or ())
    compressed = list(link.get("compressed") or ())
    return {"skipped": skipped[:LINK_SITES], "compressed": compressed[:LINK_SITES],
            "not_listed": max(0, len(skipped) - LINK_SITES)
            + max(0, len(compressed) - LINK_SITES)}


def open_summary(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The open round's progress (`open` of `fedgpu rounds --json`), its sites capped."""
    progress = doc.get("open")
    if not progress:
        return None
    sites = list(progress.get("sites") or ())
    # Uploads in flight first: the sites whose progress moves.
    sites.sort(key=lambda s: (s.get("phase") != "uploading", str(s.get("node"))))
    return {**progress, "sites": sites[:LINK_SITES],
            "sites_not_listed": max(0, len(sites) - LINK_SITES)}
