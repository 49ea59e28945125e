"""The node registry on disk (STATE_DIR/registry.sqlite): who was registered and when each was
last seen, and which nodes the operator retired, so that an aggregator restarted on the same
state directory still lists a site that has not come back (as `lost`, with its last-seen time)
and still refuses a retired one.

Its own small SQLite file, not the job store's: the registry is the long-lived federation,
jobs are the runs on it (server/jobs/store.py), and neither migrates with the other. Rows are
small and bounded (the registry's --max-nodes; MAX_RETIRED retirements, the oldest dropped);
last-seen times are written in batches (Registry.flush), never per heartbeat.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILENAME = "registry.sqlite"
MAX_RETIRED = 10_000
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    peer TEXT NOT NULL,
    version TEXT NOT NULL,
    registered_at REAL NOT NULL,
    last_seen REAL NOT NULL,
    identity TEXT NOT NULL,
    doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS retired (
    name TEXT NOT NULL,
    identity TEXT NOT NULL,
    retired_at REAL NOT NULL,
    PRIMARY KEY (name, identity)
);
"""


@dataclass(frozen=True)
class SavedNode:
    """A node as the registry last wrote it: enough to list it, not to use it (it registers
    again when it comes back)."""

    name: str
    node_id: str
    peer: str
    version: str
    registered_at: float
    last_seen: float
    identity: str
    # labels, tasks, devices, decision, rounds counters: shown by `fedgpu nodes`.
    doc: dict[str, Any]


class RegistryStore:
    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / FILENAME
        # One connection, used from the event loop's thread only.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"{self.path} was written by a newer fedgpu (registry schema "
                               f"{version}, this one knows {SCHEMA_VERSION})")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        self._db.close()

    def load(self) -> list[SavedNode]:
        rows = self._db.execute(
            "SELECT name, node_id, peer, version, registered_at, last_seen, identity, doc "
            "FROM nodes ORDER BY name").fetchall()
        out = []
        for name, node_id, peer, version, registered_at, last_seen, identity, doc in rows:
            try:
                parsed = json.loads(doc)
            except json.JSONDecodeError:
                parsed = {}
            out.append(SavedNode(name, node_id, peer, version, registered_at, last_seen,
                                 identity, parsed if isinstance(parsed, dict) else {}))
        return out

    def save(self, nodes: list[SavedNode]) -> None:
        """Insert or replace these nodes' rows (one transaction)."""
        if not nodes:
            return
        with self._tx():
            self._db.executemany(
                "INSERT OR REPLACE INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(n.name, n.node_id, n.peer, n.version, n.registered_at, n.last_seen,
                  n.identity, json.dumps(n.doc)) for n in nodes])

    def remove(self, name: str) -> None:
        self._db.execute("DELETE FROM nodes WHERE name = ?", (name,))

    def clear(self) -> None:
        """Every node retired at once (`server stop --retire-nodes`): nothing to list later."""
        self._db.execute("DELETE FROM nodes")

    def retire(self, name: str, identity: str, at: float) -> None:
        with self._tx():
            self._db.execute("INSERT OR REPLACE INTO retired VALUES (?, ?, ?)",
                             (name, identity, at))
            self._db.execute(
                "DELETE FROM retired WHERE rowid NOT IN (SELECT rowid FROM retired "
                "ORDER BY retired_at DESC LIMIT ?)", (MAX_RETIRED,))

    def retired_at(self, name: str, identity: str) -> float | None:
        row = self._db.execute("SELECT retired_at FROM retired WHERE name = ? AND identity = ?",
                               (name, identity)).fetchone()
        return None if row is None else float(row[0])

    def _tx(self) -> Any:
        return _Transaction(self._db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN")

    def __exit__(self, kind: Any, *_: Any) -> None:
        self._db.execute("COMMIT" if kind is None else "ROLLBACK")
