"""The aggregator's studies (`fedgpu studies create|enrol|withdraw|remove|list`): named groups
of sites a job can be confined to, in its state directory.

One SQLite file (`studies.db`, beside people.db): a study's name, who made it and when, and its
enrolled sites by node name (a site may be enrolled before it first registers: names are what
an admin knows). A job whose `study` key names a study samples only that study's enrolled sites
(server/rounds/eligibility.py asks `refusal`).

Before the first study is created, a study name is a label only (people's `--study`, a job's
`study` key): nothing checks it exists and a job naming one samples every site, as before
studies existed. Once any study exists, names must be of existing studies.

A site takes part in a study only if its own policy allows it: `site_refuses_study` is the one
place that asks, at enrolment and at every sampling. It allows everything until sites advertise
the studies they serve (the site-owned policy files).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fedgpu.core.errors import FedgpuError
from fedgpu.core.people import check_name
from fedgpu.core.site_policy import SitePolicy, refuses_study

STUDIES_DB = "studies.db"
# A federation's studies and a study's sites, at most: consortia, not directories.
MAX_STUDIES = 1_000
MAX_SITES_PER_STUDY = 10_000
# Names per enrol/withdraw call.
MAX_SITES_PER_CALL = 1_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS studies (
    name TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    created_by TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS enrolments (
    study TEXT NOT NULL REFERENCES studies(name) ON DELETE CASCADE,
    site TEXT NOT NULL,
    enrolled_at REAL NOT NULL,
    enrolled_by TEXT NOT NULL,
    PRIMARY KEY (study, site)
);
"""


class StudyError(FedgpuError):
    """A change that cannot be made: unknown study, duplicate, a site that refuses."""


class SiteRecord(Protocol):
    """What the policy hook sees of a site: the registry's Node fits."""

    name: str
    site_policy: SitePolicy | None


def site_refuses_study(node: SiteRecord | None, study: str) -> str | None:
    """Why the site `node` (None: not registered yet) does not serve `study`; None when it
    does: the `studies` of the policy the site advertised (fedgpu/core/site_policy.py), at
    enrolment and at every sampling. Advisory: the site checks its own file at every task
    too, so an aggregator that skipped this still gets the refusal."""
    if node is None:
        return None
    return refuses_study(getattr(node, "site_policy", None), study)


@dataclass(frozen=True)
class Study:
    name: str
    sites: tuple[str, ...] = ()
    created_at: float = 0.0
    created_by: str = ""
    enrolled: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sites": list(self.sites), "created_at": self.created_at,
                "created_by": self.created_by}


class Studies:
    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / STUDIES_DB
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        # Every sampling asks `refusal`: the enrolments are read once per change, not per node.
        self._cache: dict[str, frozenset[str]] | None = None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- changes ---------------------------------------------------------------------

    def create(self, name: str, by: str = "?") -> Study:
        check_name(name, "study")
        with self._lock:
            if self._db.execute("SELECT 1 FROM studies WHERE name = ?", (name,)).fetchone():
                raise StudyError(f"study {name!r} exists ('fedgpu studies list' shows it)")
            count = self._db.execute("SELECT COUNT(*) FROM studies").fetchone()[0]
            if count >= MAX_STUDIES:
                raise StudyError(f"the federation holds {MAX_STUDIES} studies at most")
            self._db.execute("INSERT INTO studies VALUES (?, ?, ?)", (name, time.time(), by))
            self._cache = None
        return self._must(name)

    def remove(self, name: str) -> Study:
        """Delete a study and its enrolments (its jobs keep their label and wait)."""
        study = self._must(name)
        with self._lock:
            self._db.execute("DELETE FROM studies WHERE name = ?", (name,))
            self._cache = None
        return study

    def enrol(self, name: str, sites: list[str], by: str = "?",
              nodes: dict[str, SiteRecord] | None = None) -> Study:
        """Enrol sites (node names) in a study; all or none: a site whose policy refuses
        the study refuses the whole call, with its reason. `nodes`: the registered ones."""
        self._must(name)
        names = self._check_sites(sites)
        for site in names:
            why = site_refuses_study((nodes or {}).get(site), name)
            if why is not None:
                raise StudyError(f"site {site!r} does not serve study {name!r}: {why}")
        with self._lock:
            have = self._db.execute("SELECT COUNT(*) FROM enrolments WHERE study = ?",
                                    (name,)).fetchone()[0]
            if have + len(names) > MAX_SITES_PER_STUDY:
                raise StudyError(f"a study holds {MAX_SITES_PER_STUDY} sites at most")
            now = time.time()
            self._db.executemany("INSERT OR IGNORE INTO enrolments VALUES (?, ?, ?, ?)",
                                 [(name, s, now, by) for s in names])
            self._cache = None
        return self._must(name)

    def withdraw(self, name: str, sites: list[str]) -> Study:
        study = self._must(name)
        names = self._check_sites(sites)
        missing = [s for s in names if s not in study.sites]
        if missing:
            raise StudyError(f"not enrolled in study {name!r}: {', '.join(missing[:10])}")
        with self._lock:
            self._db.executemany("DELETE FROM enrolments WHERE study = ? AND site = ?",
                                 [(name, s) for s in names])
            self._cache = None
        return self._must(name)

    # ---- lookups -----------------------------------------------------------------------

    def any(self) -> bool:
        return bool(self._roster())

    def get(self, name: str) -> Study | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM studies WHERE name = ?",
                                   (name[:64],)).fetchone()
            if row is None:
                return None
            sites = self._db.execute("SELECT site, enrolled_at FROM enrolments WHERE study = ? "
                                     "ORDER BY site", (row[0],)).fetchall()
        return Study(row[0], tuple(s for s, _ in sites), row[1], row[2], dict(sites))

    def all(self) -> list[Study]:
        with self._lock:
            names = [r[0] for r in self._db.execute("SELECT name FROM studies ORDER BY name")]
        return [s for s in (self.get(n) for n in names) if s is not None]

    def unknown(self, names: list[str] | tuple[str, ...]) -> list[str]:
        """Those of `names` that are not studies here (none while no study exists: labels)."""
        roster = self._roster()
        return [n for n in names if n not in roster] if roster else []

    def refusal(self, study: str | None, node: SiteRecord) -> str | None:
        """Why `node` is not sampled for a job of `study`; None when it may be."""
        if study is None:
            return None
        roster = self._roster()
        if not roster:
            return None  # labels only, as before studies existed
        sites = roster.get(study)
        if sites is None:
            return (f"study {study!r} does not exist on this aggregator (an admin creates it: "
                    f"'fedgpu studies create {study}')")
        if node.name not in sites:
            return f"not enrolled in study {study!r}"
        return site_refuses_study(node, study)

    def _roster(self) -> dict[str, frozenset[str]]:
        with self._lock:
            if self._cache is None:
                roster: dict[str, set[str]] = {
                    r[0]: set() for r in self._db.execute("SELECT name FROM studies")}
                for study, site in self._db.execute("SELECT study, site FROM enrolments"):
                    roster.setdefault(study, set()).add(site)
                self._cache = {k: frozenset(v) for k, v in roster.items()}
            return self._cache

    def _must(self, name: str) -> Study:
        study = self.get(name)
        if study is None:
            raise StudyError(f"no study {name[:64]!r}; 'fedgpu studies list' shows them")
        return study

    @staticmethod
    def _check_sites(sites: list[str]) -> list[str]:
        if not sites:
            raise StudyError("name at least one site (a node's name)")
        if len(sites) > MAX_SITES_PER_CALL:
            raise StudyError(f"at most {MAX_SITES_PER_CALL} sites per call")
        for site in sites:
            # Node names are free text on the node's side: printable, as a log line needs.
            if not (0 < len(site) <= 128 and site.isprintable() and site == site.strip()):
                raise StudyError(f"site name {site[:80]!r} must be a node's name: 1-128 "
                                 "printable characters")
        return list(dict.fromkeys(sites))
