"""An audit log no one can quietly edit: append-only, hash-chained JSON lines.

Each record names when, who (the actor: a certificate's CN or a token's user name), what (the
action), on what (the target) and how it ended (the outcome), and carries `prev`, the hash of
the record before it, and `hash`, the sha256 of its own canonical JSON (sorted keys, no
spaces) without `hash`. The first record of a log links to GENESIS. Changing a record breaks
its hash; deleting, inserting or moving one breaks the next record's `prev` (and `seq`);
`verify` names the first line where either happens.

What the chain cannot show alone is the loss of the newest records (a log cut after line N
is a valid log of N records). Against that, `head` is exported (`fedgpu audit verify --json`
prints it) and kept elsewhere; `verify(head=...)` then checks the log still holds it.

Threat model: someone with write access to the log's directory after the fact (an
administrator covering a tracks, a restored backup, a faulty disk). They can still rewrite
the whole chain from the first changed record on; a head hash kept outside their reach
shows that. Whoever controls the process while it writes can log lies: the log is evidence
of what the process saw, not more.

Writers: one lock per process (threads) and an flock on a lock file beside the log (the node
agent and `fedgpu node approve` write a site's log from two processes). Every append reads
the chain's last hash from the file itself under the lock, writes one line and fsyncs it. A
crash mid-write leaves a torn last line: `verify` reports it, and the next writer cuts it
off and says so in a record of its own (with the torn bytes' digest), so the chain goes on.

Rotation by size: AUDIT_FILE is renamed AUDIT_FILE.N (N = 1, 2, ... oldest first) and the
new file's first record links to the old file's last hash, so `verify` of the directory
checks one chain across all files.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AUDIT_FILE = "audit.jsonl"
GENESIS = "0" * 64
DEFAULT_MAX_BYTES = 64 << 20
# Field lengths: a record stays one short line whatever a caller passes (a megabyte job id
# echoed into a target must not make the log unreadable).
MAX_FIELD = 256
MAX_DETAIL = 2000
# How far back from the end a writer looks for the last record (records are far shorter).
TAIL_BYTES = 64 << 10
FIELDS = ("seq", "time", "actor", "action", "target", "outcome", "prev", "hash")


class AuditError(Exception):
    """The log cannot be written or read (not: it was tampered with; that is a Problem)."""


@dataclass(frozen=True)
class Problem:
    """The first thing wrong in a log: where (file and 1-based line) and what."""

    file: str
    line: int
    reason: str
    torn: bool = False

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass(frozen=True)
class Verdict:
    records: int
    head: str
    problem: Problem | None
    files: list[str]

    @property
    def ok(self) -> bool:
        return self.problem is None

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "records": self.records, "head": self.head,
                "files": self.files,
                "problem": None if self.problem is None else {
                    "file": self.problem.file, "line": self.problem.line,
                    "reason": self.problem.reason, "torn": self.problem.torn}}


def canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False).encode()


def digest(record: dict[str, Any]) -> str:
    return hashlib.sha256(canonical({k: v for k, v in record.items() if k != "hash"})
                          ).hexdigest()


def _cut(value: Any, limit: int = MAX_FIELD) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + f"...(+{len(text) - limit})"


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def files_of(path: Path) -> list[Path]:
    """The log at `path` and its rotated predecessors, oldest first."""
    rotated = []
    for p in path.parent.glob(path.name + ".*"):
        suffix = p.name[len(path.name) + 1:]
        if suffix.isdigit():
            rotated.append((int(suffix), p))
    return [p for _, p in sorted(rotated)] + ([path] if path.exists() else [])


def _last_line(path: Path) -> tuple[bytes | None, int]:
    """(the last complete line, the offset where a torn tail starts or the file size)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(0, size - TAIL_BYTES)
            fh.seek(start)
            tail = fh.read()
    except FileNotFoundError:
        return None, 0
    end = tail.rfind(b"\n")
    if end < 0:
        return None, start  # a torn first line (or nothing)
    good_end = start + end + 1
    line_start = tail.rfind(b"\n", 0, end) + 1
    return tail[line_start:end], good_end


class AuditLog:
    """Append records to the log at `path` (rotated past `max_bytes`)."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_path = path.with_name(path.name + ".lock")

    def record(self, actor: str, action: str, target: str = "", outcome: str = "ok",
               detail: str | None = None) -> dict[str, Any]:
        """Append one record (fsync'd before this returns) and return it."""
        with self._lock, open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return self._append(actor, action, target, outcome, detail)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _append(self, actor: str, action: str, target: str, outcome: str,
                detail: str | None) -> dict[str, Any]:
        prev, seq, torn = self._tail()
        if torn is not None:
            # A crash cut the last write: cut the fragment off, and say so in the chain.
            with open(self.path, "r+b") as fh:
                fh.seek(torn[0])
                fragment = fh.read()
                fh.truncate(torn[0])
                os.fsync(fh.fileno())
            prev, seq = self._write(self.path, self._make(
                "audit", "audit.torn-tail-dropped", self.path.name, "ok",
                f"{len(fragment)} bytes, sha256 {hashlib.sha256(fragment).hexdigest()}",
                prev, seq))
        if self.path.exists() and self.path.stat().st_size >= self.max_bytes:
            self._rotate()
        record = self._make(actor, action, target, outcome, detail, prev, seq)
        self._write(self.path, record)
        return record

    @staticmethod
    def _make(actor: str, action: str, target: str, outcome: str, detail: str | None,
              prev: str, seq: int) -> dict[str, Any]:
        record: dict[str, Any] = {"seq": seq, "time": _now(), "actor": _cut(actor or "?"),
                                  "action": _cut(action), "target": _cut(target),
                                  "outcome": _cut(outcome), "prev": prev}
        if detail:
            record["detail"] = _cut(detail, MAX_DETAIL)
        record["hash"] = digest(record)
        return record

    @staticmethod
    def _write(path: Path, record: dict[str, Any]) -> tuple[str, int]:
        line = canonical(record) + b"\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        return record["hash"], record["seq"] + 1

    def _tail(self) -> tuple[str, int, tuple[int, int] | None]:
        """(last hash, next seq, (torn offset, size) or None), from the files themselves."""
        for path in reversed(files_of(self.path)):
            line, good_end = _last_line(path)
            size = path.stat().st_size
            torn = (good_end, size) if path == self.path and good_end < size else None
            if line is None:
                if torn is not None and good_end == 0 and size > 0:
                    # The file's only line is torn: chain on from the file before it.
                    prev, seq, _ = self._before(path)
                    return prev, seq, torn
                continue
            try:
                last = json.loads(line)
                return str(last["hash"]), int(last["seq"]) + 1, torn
            except (ValueError, KeyError, TypeError):
                raise AuditError(f"{path}: the last record is unreadable; run 'fedgpu audit "
                                 "verify' and keep the log as evidence before writing to "
                                 "it again") from None
        return GENESIS, 0, None

    def _before(self, path: Path) -> tuple[str, int, None]:
        files = files_of(self.path)
        for older in reversed(files[:files.index(path)]):
            line, _ = _last_line(older)
            if line is not None:
                last = json.loads(line)
                return str(last["hash"]), int(last["seq"]) + 1, None
        return GENESIS, 0, None

    def _rotate(self) -> None:
        taken = [int(p.name.rsplit(".", 1)[1]) for p in files_of(self.path)[:-1]]
        target = self.path.with_name(f"{self.path.name}.{max(taken, default=0) + 1}")
        os.replace(self.path, target)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def read(path: Path) -> Iterator[dict[str, Any]]:
    """Every readable record of the log at `path` (and its rotated files), oldest first;
    unreadable lines are skipped (verify names them)."""
    for file in files_of(path):
        with open(file, "rb") as fh:
            for raw in fh:
                try:
                    doc = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(doc, dict):
                    yield doc


def page(path: Path, after_seq: int, limit: int, check: bool = False) -> dict[str, Any]:
    """Records with seq > after_seq, at most `limit`, and `next_seq` (the last one's) when
    more follow; with `check`, the verdict of `verify` (the Admin call GetAudit's document)."""
    records: list[dict[str, Any]] = []
    more = False
    for record in read(path):
        seq = record.get("seq")
        if not isinstance(seq, int) or seq <= after_seq:
            continue
        if len(records) == limit:
            more = True
            break
        records.append(record)
    doc: dict[str, Any] = {"records": records,
                           "next_seq": records[-1]["seq"] if more and records else None}
    if check:
        doc["verdict"] = verify(path).to_dict()
    return doc


def verify(path: Path, head: str | None = None) -> Verdict:
    """Check the chain across the log's files; the first Problem found, if any. With `head`
    (a hash exported earlier), the log must still hold that record."""
    files = files_of(path)
    names = [str(f) for f in files]
    expected_prev, expected_seq, count, seen_head = GENESIS, 0, 0, head is None
    for file in files:
        with open(file, "rb") as fh:
            data = fh.read()
        lines = data.split(b"\n")
        last_index = len(lines) - 1
        for index, raw in enumerate(lines):
            number = index + 1
            if index == last_index:
                if raw:
                    return Verdict(count, expected_prev, Problem(
                        str(file), number, "torn: the last line is unfinished (a write "
                        "was cut, or the file was truncated)", torn=True), names)
                break
            problem = _check_line(raw, expected_prev, expected_seq)
            if problem is not None:
                return Verdict(count, expected_prev, Problem(str(file), number, problem),
                               names)
            record = json.loads(raw)
            expected_prev, expected_seq = record["hash"], record["seq"] + 1
            count += 1
            seen_head = seen_head or record["hash"] == head
    if not seen_head:
        return Verdict(count, expected_prev, Problem(
            names[-1] if names else str(path), count,
            f"the exported head {head} is not in the log: records after it were removed "
            "(or it is another log's)"), names)
    return Verdict(count, expected_prev, None, names)


def verify_records(records: list[dict[str, Any]], source: str,
                   head: str | None = None) -> Verdict:
    """`verify` over records fetched from elsewhere (GetAudit): the same chain rules, checked
    here rather than trusted from the aggregator; a Problem's line is the record's place."""
    prev, seq, seen_head = GENESIS, 0, head is None
    for index, record in enumerate(records):
        problem = _check_line(canonical(record), prev, seq)
        if problem is not None:
            return Verdict(index, prev, Problem(source, index + 1, problem), [source])
        prev, seq = record["hash"], record["seq"] + 1
        seen_head = seen_head or prev == head
    if not seen_head:
        return Verdict(len(records), prev, Problem(
            source, len(records), f"the exported head {head} is not in the log: records "
            "after it were removed (or it is another log's)"), [source])
    return Verdict(len(records), prev, None, [source])


def _check_line(raw: bytes, prev: str, seq: int) -> str | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return "not a JSON record"
    if not isinstance(record, dict) or any(k not in record for k in FIELDS):
        return f"not an audit record (needs {', '.join(FIELDS)})"
    if digest(record) != record["hash"]:
        return "edited: the record does not match its hash"
    if record["prev"] != prev or record["seq"] != seq:
        return (f"out of chain: expected record {seq} after {prev[:12]}..., found record "
                f"{record['seq']} after {str(record['prev'])[:12]}... (a record before it was "
                "deleted, inserted or moved)")
    return None
