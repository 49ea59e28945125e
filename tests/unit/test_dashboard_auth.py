"""The dashboard's credential checks and login sessions."""

from __future__ import annotations

import pytest

from fedgpu.server.views.dashboard_auth import Sessions, bearer, token_check


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
