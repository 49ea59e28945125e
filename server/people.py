"""The aggregator's table of people (`fedgpu users add|list|revoke`), in its state directory.

One SQLite file (`people.db`, beside the job store's): a person's name, role, studies, and
their credential as the aggregator can check it without keeping it: the sha256 of their token
(the token itself is shown once, to whoever added them) or the sha256 fingerprint of their
certificate. Revoking keeps the row with its time, so a revoked credential is refused at once
and after a restart, and re-adding the name issues new credentials (the old ones stay dead).

Every lookup reads the file under one lock: a revocation counts on the very next call, and the
table is small (people, not nodes).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import threading
import time
from pathlib import Path

from fedgpu.core.errors import FedgpuError
from fedgpu.core.people import Person, PersonRole, check_name, check_studies

PEOPLE_DB = "people.db"
# People a federation holds at most: a consortium, not a user directory.
MAX_PEOPLE = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS people (
    name TEXT PRIMARY KEY,
    role TEXT NOT NULL,
    studies TEXT NOT NULL,
    token_sha256 TEXT,
    cert_sha256 TEXT,
    created_at REAL NOT NULL,
    created_by TEXT NOT NULL,
    revoked_at REAL
);
CREATE INDEX IF NOT EXISTS people_token ON people(token_sha256);
"""


class PeopleError(FedgpuError):
    """A change to the table that cannot be made (unknown name, duplicate, full)."""


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode(errors="replace")).hexdigest()


class People:
    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / PEOPLE_DB
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a revocation must survive a power cut
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- changes ---------------------------------------------------------------------

    def add(self, name: str, role: PersonRole, studies: list[str] | tuple[str, ...] = (),
            by: str = "?", cert_sha256: str | None = None) -> tuple[Person, str | None]:
        """Add a person (or re-add a revoked one with new credentials). Returns the person and
        their token (None when they use a certificate): the only time it is ever seen."""
        check_name(name)
        studies = check_studies(studies)
        role = PersonRole(role)
        token = None if cert_sha256 else "fgu_" + secrets.token_urlsafe(32)
        now = time.time()
        with self._lock:
            row = self._db.execute("SELECT revoked_at FROM people WHERE name = ?",
                                   (name,)).fetchone()
            if row is not None and row[0] is None:
                raise PeopleError(f"user {name!r} exists; revoke them first ('fedgpu users "
                                  f"revoke {name}') to issue new credentials")
            count = self._db.execute("SELECT COUNT(*) FROM people").fetchone()[0]
            if row is None and count >= MAX_PEOPLE:
                raise PeopleError(f"the federation holds {MAX_PEOPLE} people at most")
            self._db.execute(
                "INSERT OR REPLACE INTO people VALUES (?, ?, ?, ?, ?, ?, ?, NULL)",
                (name, str(role), json.dumps(list(studies)),
                 token_digest(token) if token else None, cert_sha256, now, by))
        return self.get(name), token  # type: ignore[return-value]

    def revoke(self, name: str) -> Person:
        with self._lock:
            cur = self._db.execute("UPDATE people SET revoked_at = ? WHERE name = ? AND "
                                   "revoked_at IS NULL", (time.time(), name[:64]))
            changed = cur.rowcount
        person = self.get(name[:64])
        if person is None:
            raise PeopleError(f"no user {name[:64]!r}; 'fedgpu users list' shows them")
        if not changed:
            raise PeopleError(f"user {name!r} was already revoked")
        return person

    # ---- lookups -----------------------------------------------------------------------

    def any(self) -> bool:
        """Whether anyone was ever added (revoked or not)."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM people LIMIT 1").fetchone() is not None

    def all(self) -> list[Person]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM people ORDER BY name").fetchall()
        return [_person(r) for r in rows]

    def get(self, name: str) -> Person | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM people WHERE name = ?", (name,)).fetchone()
        return _person(row) if row else None

    def by_token(self, token: str) -> Person | None:
        """The person whose token this is (revoked ones too: the caller says why it refuses)."""
        if not token:
            return None
        with self._lock:
            row = self._db.execute("SELECT * FROM people WHERE token_sha256 = ?",
                                   (token_digest(token),)).fetchone()
        return _person(row) if row else None

    def cert_sha256(self, name: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT cert_sha256 FROM people WHERE name = ?",
                                   (name,)).fetchone()
        return row[0] if row else None


def _person(row: tuple) -> Person:  # type: ignore[type-arg]
    name, role, studies, token_sha, cert_sha, created_at, created_by, revoked_at = row
    return Person(name, PersonRole(role), tuple(json.loads(studies)),
                  credential="certificate" if cert_sha else "token", created_at=created_at,
                  created_by=created_by, revoked_at=revoked_at)
