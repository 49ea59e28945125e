"""What the views show of a job's differential privacy: the budget and the epsilon spent, per
round and so far, read from the round records (each finished round's "privacy" entry, written
by server/strategies/private.py) and the job's `[privacy]` settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedgpu.core.constants import RoundStatus


def per_round(rounds: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """[{round, epsilon}] of the finished rounds, in order: epsilon is the total after it."""
    return [{"round": r["round"], "epsilon": r["privacy"]["epsilon"]} for r in rounds
            if r.get("status") == RoundStatus.FINISHED and isinstance(r.get("privacy"), dict)]


def summary(job: Mapping[str, Any], rounds: Sequence[Mapping[str, Any]]
            ) -> dict[str, Any] | None:
    """`job status --json` "privacy": None for a job without `[privacy]`."""
    settings = job.get("privacy")
    if not isinstance(settings, Mapping):
        return None
    spent = per_round(rounds)
    last = next((r["privacy"] for r in reversed(rounds)
                 if r.get("status") == RoundStatus.FINISHED
                 and isinstance(r.get("privacy"), dict)), None)
    return {
        "mode": settings.get("mode"),
        "target_epsilon": settings.get("target_epsilon"),
        "delta": settings.get("delta"),
        "epsilon_spent": spent[-1]["epsilon"] if spent else 0.0,
        "rounds_accounted": len(spent),
        "noise_multiplier": (last or {}).get("noise_multiplier",
                                             settings.get("noise_multiplier")),
        "clip_norm": (last or {}).get("next_clip_norm", (last or {}).get(
            "clip_norm", settings.get("clip_norm"))),
        "per_round": spent,
    }
