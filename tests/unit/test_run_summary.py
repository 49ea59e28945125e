"""`fedgpu run`'s last lines: rounds of the model, not attempts (a run whose rounds were
retried twice says "9 rounds (2 attempts retried)", not "11 rounds"), and what a private job
spent of its budget."""

from __future__ import annotations

from fedgpu.cli.run.launcher import privacy_line, rounds_summary


def test_the_summary_counts_finished_rounds_not_attempts() -> None:
    rounds = [{"round": r, "status": "finished"} for r in range(1, 10)]
    rounds.insert(3, {"round": 4, "status": "retried"})
    rounds.insert(7, {"round": 7, "status": "retried"})
    assert rounds_summary(rounds) == "9 rounds (2 attempts retried)"
    assert rounds_summary([{"round": 1, "status": "retried"},
                           {"round": 1, "status": "finished"}]) == "1 round (1 attempt retried)"
    assert rounds_summary(rounds[:3]) == "3 rounds"


def test_the_summary_says_what_the_privacy_budget_spent() -> None:
    status = {"reason": "privacy budget spent after 9 rounds, epsilon 7.59 of 8",
              "privacy": {"mode": "central", "target_epsilon": 8.0, "delta": 1e-5,
                          "epsilon_spent": 7.5912, "rounds_accounted": 9}}
    assert privacy_line(status) == (
        "privacy (central): epsilon 7.59 of 8 spent over 9 rounds (privacy budget spent "
        "after 9 rounds, epsilon 7.59 of 8)")
    assert privacy_line({"privacy": None}) == ""
