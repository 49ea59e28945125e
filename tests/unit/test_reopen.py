"""The open attempt on disk (server/rounds/reopen.py): what a restarted aggregator reopens, and
what it refuses to reopen (then a new attempt starts, as before)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

from fedgpu.server.rounds.reopen import (
    ATTEMPT_FILE,
    MAX_FILE_BYTES,
    AttemptFile,
    Reopener,
    SavedAttempt,
    why_not,
)

MODEL = "ab" * 32


def _saved(**over: object) -> SavedAttempt:
    fields = dict(run_id="run1", round=3, attempt=2, kind=2, model_digest=MODEL,
                  deadline=1000.0, saved_at=990.0, tasks={"site-a": "t1", "site-b": "t2"})
    fields.update(over)
    return SavedAttempt(**fields)  # type: ignore[arg-type]


def test_an_attempt_survives_a_new_process_as_it_was_saved(tmp_path: Path) -> None:
    AttemptFile(tmp_path).save(_saved())
    assert AttemptFile(tmp_path).load() == _saved()
    AttemptFile(tmp_path).clear()
    assert AttemptFile(tmp_path).load() is None
    assert AttemptFile(None).load() is None  # a run without a checkpoint keeps nothing


def test_a_damaged_or_oversized_file_is_ignored_not_trusted(tmp_path: Path) -> None:
    (tmp_path / ATTEMPT_FILE).write_text('{"version": 1, "tasks": {"a": 3}}')
    assert AttemptFile(tmp_path).load() is None
    (tmp_path / ATTEMPT_FILE).write_text("x" * (MAX_FILE_BYTES + 1))
    assert AttemptFile(tmp_path).load() is None


def test_only_the_same_run_round_model_and_a_fresh_enough_attempt_is_reopened() -> None:
    args = dict(run_id="run1", number=3, kind=2, model_digest=MODEL, deadline_s=60.0,
                now=1010.0)
    assert why_not(_saved(), **args) is None  # type: ignore[arg-type]
    for change, what in [({"run_id": "run2"}, "run"), ({"number": 4}, "round"),
                         ({"model_digest": "cd" * 32}, "model"), ({"now": 1061.0}, "deadline")]:
        why = why_not(_saved(), **{**args, **change})  # type: ignore[arg-type]
        assert why is not None and what in why, (change, why)


def test_a_reopened_attempt_waits_a_bounded_time_for_its_sites_to_register_again() -> None:
    a, b = SimpleNamespace(name="site-a"), SimpleNamespace(name="site-b")
    calls = []

    def connected() -> list:  # type: ignore[type-arg]
        calls.append(1)
        return [a, b] if len(calls) >= 2 else [a]

    got = asyncio.run(Reopener.gather(_saved(), [a], connected, 60.0))  # type: ignore[list-item]
    assert got == [a, b] and len(calls) == 2
    # One that never comes back is waited for at most half a round deadline.
    t0 = time.monotonic()
    got = asyncio.run(Reopener.gather(_saved(), [a], lambda: [a], 1.0))  # type: ignore[list-item]
    assert got == [a] and 0.4 < time.monotonic() - t0 < 3
    assert Reopener.sites(_saved(), [a], 2) is None  # type: ignore[list-item]
    assert Reopener.sites(_saved(), [a, b], 2) == [a, b]  # type: ignore[list-item]
