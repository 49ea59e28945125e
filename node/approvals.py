"""A site's task bundles: the cache of archives it was sent and its allow-list, in the node's
state directory (`--state-dir`, FEDGPU_NODE_STATE), shared by every agent of the site and by
`fedgpu node approve|reject|tasks`.

```
STATE/bundles/<sha256>.tar    the archive as fetched (checked before it was kept)
STATE/bundles/<sha256>.json   name, entry, requires, size, the job it came with, first seen
STATE/approved/<sha256>       on the allow-list (when, and from what)
STATE/rejected/<sha256>       refused by the site
STATE/audit.jsonl             the site's audit log (fedgpu.core.audit): every decision here,
                              and the tasks the agents ran or refused
```

One small file per fact, each written to a temporary name and renamed: the CLI and running
agents never read half a decision, and no list is read-modified-written by two processes at
once. Agents read the decision files whenever they need them, so an approval counts at once,
without a restart. Torch-free and import-free: nothing here runs bundle code.
"""

from __future__ import annotations

import getpass
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedgpu.core.audit import AUDIT_FILE, AuditLog
from fedgpu.core.bundles import Bundle, BundleError, check_sha256, digest
from fedgpu.core.constants import BundleState

STATE_ENV = "FEDGPU_NODE_STATE"
# Bundles a site lists at most: the files are tiny, but a listing must stay readable.
MAX_LISTED = 10_000


def default_state_dir() -> Path:
    """Where a node keeps its state when neither --state-dir nor FEDGPU_NODE_STATE says: the
    XDG state directory of the user running it (the node image sets FEDGPU_NODE_STATE)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "fedgpu" / "node"


@dataclass(frozen=True)
class BundleRecord:
    """One bundle as `fedgpu node tasks --json` lists it."""

    sha256: str
    state: BundleState
    name: str | None
    entry: str | None
    requires: list[str]
    size: int | None
    job: str | None
    first_seen: float | None
    decided_at: float | None
    archive: str | None

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["state"] = str(self.state)
        return doc


class SiteTasks:
    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir).resolve()
        self.cache = self.root / "bundles"
        # Rejection is looked at first: while a decision changes both files exist for an
        # instant, and then the bundle must not run.
        self._dirs = {BundleState.REJECTED: self.root / "rejected",
                      BundleState.APPROVED: self.root / "approved"}

    # ---- decisions ----------------------------------------------------------------------

    def state(self, sha256: str) -> BundleState | None:
        """The site's decision, PENDING when only seen, None when never heard of."""
        for state, folder in self._dirs.items():
            if (folder / sha256).exists():
                return state
        return BundleState.PENDING if self.meta_path(sha256).exists() else None

    def approve(self, sha256: str, source: str) -> None:
        self._decide(BundleState.APPROVED, sha256, source)

    def reject(self, sha256: str, source: str) -> None:
        self._decide(BundleState.REJECTED, sha256, source)

    def _decide(self, state: BundleState, sha256: str, source: str) -> None:
        sha256 = check_sha256(sha256)
        folder = self._dirs[state]
        folder.mkdir(parents=True, exist_ok=True)
        _write_json(folder / sha256, {"time": time.time(), "source": source})
        # The new decision is in place before the old one goes: never neither.
        for other, other_folder in self._dirs.items():
            if other is not state:
                (other_folder / sha256).unlink(missing_ok=True)
        # Who decided: the local account that ran `fedgpu node approve|reject`.
        AuditLog(self.root / AUDIT_FILE).record(
            _local_user(), "bundle.approve" if state == BundleState.APPROVED
            else "bundle.reject", sha256, "OK", f"from {source}")

    # ---- the cache ----------------------------------------------------------------------

    def archive_path(self, sha256: str) -> Path:
        return self.cache / f"{check_sha256(sha256)}.tar"

    def meta_path(self, sha256: str) -> Path:
        return self.cache / f"{check_sha256(sha256)}.json"

    def keep(self, bundle: Bundle, job_id: str) -> Path:
        """Cache a checked bundle (its archive and what it is); the first sighting is kept."""
        self.cache.mkdir(parents=True, exist_ok=True)
        path = self.archive_path(bundle.sha256)
        _write_bytes(path, bundle.data)
        meta = self.meta_path(bundle.sha256)
        if not meta.exists():
            _write_json(meta, {"sha256": bundle.sha256, "name": bundle.manifest.name,
                               "entry": bundle.manifest.entry,
                               "requires": list(bundle.manifest.requires),
                               "size": bundle.size, "job": job_id or None,
                               "first_seen": time.time()})
        return path

    def cached(self, sha256: str) -> bytes | None:
        """The cached archive's bytes, None when not cached; BundleError when its content no
        longer matches its hash (then it is removed, so the next task fetches it afresh)."""
        path = self.archive_path(sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if digest(data) != sha256:
            path.unlink(missing_ok=True)
            raise BundleError(f"the cached copy of bundle {sha256} ({path}) no longer matches "
                              "its hash: it changed on disk after it was fetched and checked; "
                              "it was removed and is fetched again with the next task")
        return data

    # ---- listing ------------------------------------------------------------------------

    def records(self) -> list[BundleRecord]:
        """Every bundle the site has seen or decided on, the newest first."""
        shas: set[str] = set()
        if self.cache.is_dir():
            shas.update(p.stem for p in self.cache.glob("*.json"))
        for folder in self._dirs.values():
            if folder.is_dir():
                shas.update(p.name for p in folder.iterdir() if not p.name.startswith("."))
        out = []
        for sha in sorted(shas)[:MAX_LISTED]:
            try:
                check_sha256(sha)
            except BundleError:
                continue  # a stray file someone put there
            out.append(self.record(sha))
        return sorted(out, key=lambda r: -(r.first_seen or r.decided_at or 0))

    def record(self, sha256: str) -> BundleRecord:
        meta = _read_json(self.meta_path(sha256)) or {}
        state = self.state(sha256) or BundleState.PENDING
        decided = (_read_json(self._dirs[state] / sha256) or {}) if state in self._dirs else {}
        archive = self.archive_path(sha256)
        return BundleRecord(
            sha256=sha256, state=state, name=meta.get("name"), entry=meta.get("entry"),
            requires=list(meta.get("requires") or []), size=meta.get("size"),
            job=meta.get("job"), first_seen=meta.get("first_seen"),
            decided_at=decided.get("time"),
            archive=str(archive) if archive.exists() else None)

    def resolve(self, prefix: str) -> str:
        """A full sha256 from itself or from a prefix (at least 8 characters) that names one
        bundle this site knows; BundleError otherwise."""
        text = prefix.strip().lower()
        if len(text) == 64:
            return check_sha256(text)
        if len(text) < 8 or not all(c in "0123456789abcdef" for c in text):
            raise BundleError(f"{prefix!r} is not a bundle hash: give the 64-character sha256 "
                              "(or at least its first 8 characters) that 'fedgpu node tasks' "
                              "lists")
        found = [r.sha256 for r in self.records() if r.sha256.startswith(text)]
        if len(found) != 1:
            raise BundleError(f"{prefix!r} names {len(found)} bundles known at this site "
                              f"({self.root}); give more of the hash")
        return found[0]


def _local_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's arbitrary user)
        return f"uid {os.getuid()}"


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    _write_bytes(path, (json.dumps(doc, indent=2) + "\n").encode())


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
