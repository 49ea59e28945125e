"""`job status --json` "statistics" for a `mode = "statistics"` job: the per-site and combined
figures the round's record holds (server/rounds/statistics.py writes them), and which round
they are of. None while no round closed."""

from __future__ import annotations

from typing import Any


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    last = next((r for r in reversed(rounds) if isinstance(r.get("statistics"), dict)), None)
    if last is None:
        return None
    return {"round": last.get("round"), "status": last.get("status"), **last["statistics"]}
