"""Who may read the dashboard: a person's token or the operator token, as a Bearer header or
a login cookie.

The cookie holds a random session id, never the token itself: a copied cookie expires, logging
out ends it, and the token is checked again on every request, so changing the operator
credential locks every open session out.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fedgpu.core.people import Person, PersonRole

COOKIE = "fedgpu_session"
SESSION_TTL_S = 12 * 3600
MAX_SESSIONS = 256


def legacy_person() -> Person:
    """The holder of the single operator token: an admin, as before people existed."""
    return Person("operator", PersonRole.ADMIN, implicit=True)


def token_check(expected: str) -> Callable[[str], bool]:
    """`is_operator` for one shared token, compared in constant time."""
    want = expected.encode()
    if not want:
        raise ValueError("an empty token would let anyone in")

    def is_operator(presented: str) -> bool:
        return hmac.compare_digest(presented.encode(errors="replace"), want)

    return is_operator


def bearer(header: str) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, else None."""
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    return value if scheme.lower() == "bearer" and value else None


@dataclass
class _Session:
    token: str
    expires: float


class Sessions:
    """Login sessions in memory (they end with the process: logging in again is cheap).

    Bounded: past `limit` the oldest session is dropped, so repeated logins cannot grow it.
    """

    def __init__(self, ttl_s: float = SESSION_TTL_S, limit: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()

    def create(self, token: str) -> str:
        sid = secrets.token_urlsafe(32)
        self._sessions[sid] = _Session(token, self._clock() + self.ttl_s)
        while len(self._sessions) > self.limit:
            self._sessions.popitem(last=False)
        return sid

    def token(self, sid: str) -> str | None:
        """The token the session logged in with; None if unknown or expired."""
        session = self._sessions.get(sid)
        if session is None:
            return None
        if session.expires <= self._clock():
            del self._sessions[sid]
            return None
        return session.token

    def drop(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def __len__(self) -> int:
        return len(self._sessions)


@dataclass
class _Failures:
    count: int
    last: float
    blocked_until: float = 0.0


class FailureThrottle:
    """Slows repeated wrong tokens per address: the first `free` failures cost nothing (a
    typo, a stale bookmark), each one after that locks the address out for twice as long as
    the last, up to `max_s`; a success or `forget_s` without failures starts it over.

    Bounded: at most `limit` addresses are remembered, the least recently failing dropped
    first, so a flood from many addresses cannot grow it (it can only age out its own
    entries)."""

    def __init__(self, free: int = 10, base_s: float = 1.0, max_s: float = 60.0,
                 forget_s: float = 600.0, limit: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.free, self.base_s, self.max_s = free, base_s, max_s
        self.forget_s, self.limit = forget_s, limit
        self._clock = clock
        self._by_address: OrderedDict[str, _Failures] = OrderedDict()

    def wait_s(self, address: str) -> float:
        """Seconds before `address` may present a token again (0: now)."""
        entry = self._by_address.get(address)
        return 0.0 if entry is None else max(0.0, entry.blocked_until - self._clock())

    def failed(self, address: str) -> None:
        now = self._clock()
        entry = self._by_address.pop(address, None)
        if entry is None or now - entry.last > self.forget_s:
            entry = _Failures(0, now)
        entry.count += 1
        entry.last = now
        if entry.count > self.free:
            entry.blocked_until = now + min(self.max_s,
                                            self.base_s * 2 ** min(entry.count - self.free - 1,
                                                                   32))
        self._by_address[address] = entry
        while len(self._by_address) > self.limit:
            self._by_address.popitem(last=False)

    def succeeded(self, address: str) -> None:
        self._by_address.pop(address, None)

    def __len__(self) -> int:
        return len(self._by_address)
