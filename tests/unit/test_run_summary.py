"""`fedgpu run`'s last line counts rounds of the model, not attempts: a run whose rounds were
retried twice says "9 rounds (2 attempts retried)", not "11 rounds"."""

from __future__ import annotations

from fedgpu.cli.run.launcher import rounds_summary


def test_the_summary_counts_finished_rounds_not_attempts() -> None:
    rounds = [{"round": r, "status": "finished"} for r in range(1, 10)]
    rounds.insert(3, {"round": 4, "status": "retried"})
    rounds.insert(7, {"round": 7, "status": "retried"})
    assert rounds_summary(rounds) == "9 rounds (2 attempts retried)"
    assert rounds_summary([{"round": 1, "status": "retried"},
                           {"round": 1, "status": "finished"}]) == "1 rounds (1 attempt retried)"
    assert rounds_summary(rounds[:3]) == "3 rounds"
