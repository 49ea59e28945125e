"""Which global models this site has answered a secure-aggregation unmask request for.

One unmasking per round, from the site's side: whoever holds two unmasked sums of one round,
one with this site's input and one without (or two with it, from two attempts that trained on
the same model), holds this site's update as their difference. The aggregator's driver never
unmasks a sum of fewer sites than the round needs, but a site does not rely on the aggregator:
it answers the unmask step at most once per global model it trained from (the digest of the
TRAIN task's payload). It is written to the site's state directory, before the reply leaves,
so a restarted node remembers it.

Keyed by the model's digest, and also by (job, round) where the task names its job (the
`job_terms` a site policy reads): the aggregator names rounds and jobs itself and could relabel
them, but it cannot make a site train from another model under the same digest, and every
attempt of one round sends the same model; the (job, round) key adds that a slightly changed
model under the same job and round is refused too. The round number is
kept for the log. A retried attempt that failed before unmasking never reached this ledger, so it is
answered as usual. A new job whose first model is byte-identical to one this site already
unmasked for is refused too, on purpose: the site's update would be close to the first one.

A JSON line per answer: {"digest": "...", "round": N, "job": "..." (when named), "at": unix
seconds}.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("fedgpu.node.secagg")

FILE_NAME = "secagg-unmasked.jsonl"
# A bound on what is read back: far more rounds than a site takes part in over years.
MAX_ENTRIES = 1_000_000
MAX_LINE = 512


class UnmaskLedger:
    """`path` None: kept in memory only (a simulated node)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._digests: dict[str, int] = {}
        self._job_rounds: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        if path is not None and path.exists():
            self._load(path)

    def _load(self, path: Path) -> None:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh):
                if n >= MAX_ENTRIES:
                    log.warning("%s: more than %d entries, the rest not read", path, MAX_ENTRIES)
                    break
                try:
                    doc = json.loads(line[:MAX_LINE])
                    self._digests[str(doc["digest"])] = int(doc["round"])
                    if doc.get("job"):
                        self._job_rounds.add((str(doc["job"]), int(doc["round"])))
                except (ValueError, KeyError, TypeError):
                    # A torn last line (a crash mid-write): the reply it guarded never left.
                    continue

    def problem(self, digest: str, job: str = "", round_: int = 0) -> str | None:
        """Why this site must not answer an unmask request for a round trained from the model
        of `digest` (round `round_` of `job`, when the task names its job); None when it may."""
        if not digest:
            return "the training task named no digest of its model"
        with self._lock:
            if digest in self._digests:
                return (f"it already answered an unmask request for round "
                        f"{self._digests[digest]}, trained from this same model "
                        f"({digest[:16]}...): a second sum that includes it would give its "
                        "update away")
            if job and (job, round_) in self._job_rounds:
                return (f"it already answered an unmask request for round {round_} of job "
                        f"{job[:64]}: a second sum of that round (here from another model) "
                        "that includes it would give its update away")
        return None

    def record(self, digest: str, round_: int, job: str = "") -> None:
        """Remember the answer; on disk (fsync) before the reply is sent. OSError when it
        cannot be written: the site then does not answer."""
        with self._lock:
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                entry: dict[str, object] = {"digest": digest, "round": round_}
                if job:
                    entry["job"] = job[:128]
                entry["at"] = round(time.time(), 3)
                line = json.dumps(entry) + "\n"
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, line.encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self._digests[digest] = round_
            if job:
                self._job_rounds.add((job[:128], round_))
