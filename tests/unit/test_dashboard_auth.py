"""The dashboard's credential checks and login sessions."""

from __future__ import annotations

import pytest

from fedgpu.server.views.dashboard_auth import FailureThrottle, Sessions, bearer, token_check


def test_token_check() -> None:
    is_operator = token_check("s3cret")
    assert is_operator("s3cret")
    assert not is_operator("s3cret ")
    assert not is_operator("")
    assert not is_operator("S3CRET")
    assert not is_operator("s3cret-and-more")
    assert not is_operator("\udcff")  # not encodable as UTF-8: refused, no exception
    with pytest.raises(ValueError, match="empty token"):
        token_check("")


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer", None),
    ("Bearer ", None), ("", None), ("abc", None),
])
def test_bearer(header: str, token: str | None) -> None:
    assert bearer(header) == token


def test_sessions_expire_and_end() -> None:
    now = [100.0]
    sessions = Sessions(ttl_s=60, clock=lambda: now[0])
    sid = sessions.create("tok")
    assert len(sid) >= 40 and sessions.token(sid) == "tok"
    assert sessions.token("forged") is None
    now[0] += 59
    assert sessions.token(sid) == "tok"
    now[0] += 1
    assert sessions.token(sid) is None and len(sessions) == 0
    sid = sessions.create("tok")
    sessions.drop(sid)
    assert sessions.token(sid) is None


def test_sessions_are_bounded_oldest_first() -> None:
    sessions = Sessions(limit=3)
    ids = [sessions.create(f"t{i}") for i in range(5)]
    assert len(sessions) == 3
    assert [sessions.token(i) for i in ids] == [None, None, "t2", "t3", "t4"]


def test_failures_lock_an_address_out_for_longer_each_time() -> None:
    clock = [100.0]
    throttle = FailureThrottle(free=3, base_s=1.0, max_s=8.0, forget_s=60.0,
                               clock=lambda: clock[0])
    for _ in range(3):
        throttle.failed("10.0.0.1")
        assert throttle.wait_s("10.0.0.1") == 0
    waits = []
    for _ in range(6):
        throttle.failed("10.0.0.1")
        waits.append(throttle.wait_s("10.0.0.1"))
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert throttle.wait_s("10.0.0.2") == 0
    clock[0] += 8.0
    assert throttle.wait_s("10.0.0.1") == 0
    throttle.succeeded("10.0.0.1")
    throttle.failed("10.0.0.1")
    assert throttle.wait_s("10.0.0.1") == 0  # a success starts it over
    for _ in range(5):
        throttle.failed("10.0.0.3")
    clock[0] += 61.0
    throttle.failed("10.0.0.3")
    assert throttle.wait_s("10.0.0.3") == 0  # forgotten after a quiet minute


def test_the_failure_table_is_bounded() -> None:
    throttle = FailureThrottle(limit=100)
    for i in range(10_000):
        throttle.failed(f"2001:db8::{i:x}")
    assert len(throttle) == 100
