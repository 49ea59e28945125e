"""The agent's one retry rule (node/retry.py): backoff with jitter, a deadline, a stop event."""

from __future__ import annotations

import random
import threading
import time

import pytest

from fedgpu.node.retry import GaveUp, RetryPolicy, Stopped, retry


class Flaky:
    """Fails with `error` the first `failures` calls, then answers."""

    def __init__(self, failures: int, error: Exception | None = None) -> None:
        self.failures, self.calls = failures, 0
        self.error = error or ConnectionError("down")

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


FAST = RetryPolicy(base_s=0.001, cap_s=0.01)


def test_retries_until_the_call_answers() -> None:
    call, waits = Flaky(4), []
    got = retry(call, what="x", policy=FAST, retryable=lambda e: isinstance(e, ConnectionError),
                stop=threading.Event(), on_retry=lambda e, d: waits.append(d))
    assert got == "ok" and call.calls == 5 and len(waits) == 4


def test_an_error_that_is_not_retryable_propagates_at_once() -> None:
    call = Flaky(3, ValueError("refused"))
    with pytest.raises(ValueError, match="refused"):
        retry(call, what="x", policy=FAST, retryable=lambda e: isinstance(e, ConnectionError),
              stop=threading.Event())
    assert call.calls == 1


def test_gives_up_at_the_deadline_not_before_and_not_much_after() -> None:
    call = Flaky(10**9)
    policy = RetryPolicy(base_s=0.05, cap_s=0.2, deadline_s=1.0)
    start = time.monotonic()
    with pytest.raises(GaveUp) as info:
        retry(call, what="register", policy=policy, retryable=lambda e: True,
              stop=threading.Event())
    elapsed = time.monotonic() - start
    assert 1.0 <= elapsed < 5.0
    assert info.value.attempts == call.calls >= 3
    assert isinstance(info.value.last, ConnectionError)
    assert str(info.value).startswith("register: gave up after")


def test_stop_ends_the_wait_at_once() -> None:
    stop = threading.Event()
    policy = RetryPolicy(base_s=30, cap_s=30)  # every wait would be long
    threading.Timer(0.3, stop.set).start()
    start = time.monotonic()
    with pytest.raises(Stopped):
        retry(Flaky(10**9), what="pull", policy=policy, retryable=lambda e: True, stop=stop)
    assert time.monotonic() - start < 10


def test_delays_grow_exponentially_with_full_jitter_and_a_cap() -> None:
    policy = RetryPolicy(base_s=0.5, cap_s=15.0)
    rng = random.Random(0)
    for attempt in range(1, 12):
        ceiling = min(15.0, 0.5 * 2 ** attempt)
        samples = [policy.delay(attempt, rng) for _ in range(400)]
        assert all(0 <= d <= ceiling for d in samples)
        # Jitter spreads over the whole range, so a fleet does not retry in lockstep.
        assert max(samples) > 0.9 * ceiling and min(samples) < 0.1 * ceiling
    assert policy.delay(10**6, rng) <= 15.0  # no overflow on long outages
