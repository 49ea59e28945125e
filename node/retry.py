"""One retry rule for every call the agent makes to the aggregator: register, pull, report.

Exponential backoff with full jitter (so a fleet restarted together does not reconnect in
lockstep) and a deadline (so a caller that must give up does, at a time it chose). Whether an
error is worth another try is the caller's decision; the helper only waits and counts. It is
hand-written rather than taken from tenacity or backoff because it must wait on the agent's stop
event (a SIGTERM ends the wait at once) and that is the whole of it: a loop of a dozen lines.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying: `deadline_s` after the first attempt (None: until stopped)."""

    base_s: float = 0.5
    cap_s: float = 15.0
    deadline_s: float | None = None

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2**attempt)] for attempt 1, 2, ..."""
        ceiling = min(self.cap_s, self.base_s * 2 ** min(attempt, 32))
        return (rng or random).uniform(0, ceiling)


class GaveUp(Exception):
    """The deadline passed while the call kept failing with retryable errors."""

    def __init__(self, what: str, attempts: int, waited_s: float, last: BaseException) -> None:
        super().__init__(f"{what}: gave up after {attempts} attempts in {waited_s:.0f}s "
                         f"({last})")
        self.what, self.attempts, self.waited_s, self.last = what, attempts, waited_s, last


class Stopped(Exception):
    """The stop event was set while waiting to try again."""


def retry(call: Callable[[], T], *, what: str, policy: RetryPolicy,
          retryable: Callable[[BaseException], bool], stop: threading.Event,
          on_retry: Callable[[BaseException, float], None] | None = None,
          clock: Callable[[], float] = time.monotonic) -> T:
    """`call()` until it returns; errors `retryable` rejects propagate at once.

    Raises GaveUp when the next wait would end past the deadline, Stopped when `stop` is set.
    `on_retry(error, delay)` runs before each wait (logging, state changes).
    """
    started = clock()
    attempt = 0
    while True:
        if stop.is_set():
            raise Stopped(what)
        try:
            return call()
        except Exception as exc:
            if not retryable(exc):
                raise
            attempt += 1
            delay = policy.delay(attempt)
            elapsed = clock() - started
            if policy.deadline_s is not None and elapsed + delay > policy.deadline_s:
                # Waiting would overshoot: wait only what is left, then one last try.
                left = policy.deadline_s - elapsed
                if left <= 0:
                    raise GaveUp(what, attempt, elapsed, exc) from exc
                delay = left
            if on_retry is not None:
                on_retry(exc, delay)
            if stop.wait(delay):
                raise Stopped(what) from exc


class Repeats:
    """The wait before an action that keeps coming back, such as registering again after the
    aggregator forgot us: none the first time or after a quiet spell of `window_s`, then
    doubling up to `cap_s` while it keeps coming back sooner. (Two agents evicting each other
    re-registered 517 times in 7 s before this.)"""

    def __init__(self, base_s: float = 1.0, cap_s: float = 30.0, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s, self.cap_s, self.window_s, self._clock = base_s, cap_s, window_s, clock
        self._last: float | None = None
        self.streak = 0

    def next_delay(self) -> float:
        now = self._clock()
        if self._last is None or now - self._last > self.window_s:
            self.streak = 0
        else:
            self.streak += 1
        self._last = now
        return 0.0 if self.streak == 0 else min(self.cap_s, self.base_s * 2 ** (self.streak - 1))
