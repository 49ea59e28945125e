"""Lines of `fedgpu run`'s closing summary, from the aggregator's documents."""

from __future__ import annotations

from typing import Any


def privacy_line(status: dict[str, Any]) -> str:
    """"privacy: epsilon 7.59 of 8 spent over 9 rounds (privacy budget spent after ...)" from
    `status --json`; empty for a job without [privacy]."""
    p = status.get("privacy")
    if not isinstance(p, dict):
        return ""
    spent, target = p.get("epsilon_spent"), p.get("target_epsilon")
    shown = "infinite" if spent is None else f"{spent:.2f}"
    of = f" of {target:g}" if target is not None else ""
    why = f" ({status['reason']})" if status.get("reason") else ""
    return (f"privacy ({p.get('mode')}): epsilon {shown}{of} spent over "
            f"{p.get('rounds_accounted', 0)} rounds{why}")


def rounds_summary(rounds: list[dict[str, Any]]) -> str:
    """"9 rounds (2 attempts retried)": rounds of the model, not attempts."""
    done = sum(1 for r in rounds if r.get("status", "finished") == "finished")
    retried = len(rounds) - done
    again = f" ({retried} attempt{'s' if retried != 1 else ''} retried)" if retried else ""
    return f"{done} round{'s' if done != 1 else ''}{again}"
