"""The open training attempt on disk, so that an aggregator killed in the middle of a round
(SIGKILL, a crash, a node of the cluster lost) reopens that very attempt when it comes back,
instead of starting a new one that every site would have to train for again.

What is kept (ATTEMPT_FILE in the job's checkpoint directory, JSON written atomically, no
pickle): the run, the round and its attempt number, the digest of the global model the
attempt sent, its deadline, and the task id each site was handed. Updates are not kept here:
nothing of an attempt is committed before it closes, so a restarted aggregator folds the
attempt again from the checkpointed model, and every site answers it again from the update it
kept (node/unacked.py: a site keeps its last training update, acknowledged or not, until the
aggregator moves on). A site whose upload the kill cut resends it from byte 0 (what had arrived
lived in the aggregator's memory); a site accepted before the kill is handed the same task id
again and resends its kept copy; none trains again for that attempt.

The attempt is reopened only when all of this holds, else a new attempt starts as before:
- the same run, the round after the last committed one, a plain star training round (secure
  aggregation, ring and async rounds start a new attempt);
- the global model the restarted aggregator would send has the digest the attempt sent, so an
  update made from it is an answer to this model and no other;
- it is not stale: the aggregator came back before the attempt's deadline plus one more
  round deadline (MAX_LATE); a reopened attempt gets a whole round deadline from the restart;
- at least the attempt's required number of its sites are still registered.
The file is overwritten by the next attempt, and removed when the run finishes or fails.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fedgpu.core.job import Job
from fedgpu.server.registry import Node
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.plans import Plan, StarPlan

log = logging.getLogger("fedgpu.server.rounds.reopen")

ATTEMPT_FILE = "attempt.json"
# A saved attempt is a few ids per site: a file past this is not ours.
MAX_FILE_BYTES = 4 << 20
VERSION = 1
# How long a reopened attempt waits for the last of its sites to register again.
GATHER_S = 15.0


@dataclass(frozen=True)
class SavedAttempt:
    run_id: str
    round: int
    attempt: int
    kind: int
    model_digest: str
    deadline: float
    saved_at: float
    # site (node name) -> the task id it was handed; node ids do not outlive a restart (a
    # site registers again), names do
    tasks: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"version": VERSION, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SavedAttempt:
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise ValueError("not a saved attempt of this version")
        tasks = doc.get("tasks")
        if not isinstance(tasks, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in tasks.items()):
            raise ValueError("tasks must map site names to task ids")
        return cls(run_id=str(doc["run_id"]), round=int(doc["round"]),
                   attempt=int(doc["attempt"]), kind=int(doc["kind"]),
                   model_digest=str(doc["model_digest"]), deadline=float(doc["deadline"]),
                   saved_at=float(doc["saved_at"]), tasks=dict(tasks))


class AttemptFile:
    """The saved attempt of one run, in `directory` (None: the run is not checkpointed)."""

    def __init__(self, directory: Path | None) -> None:
        self.path = directory / ATTEMPT_FILE if directory is not None else None

    def save(self, saved: SavedAttempt) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{ATTEMPT_FILE}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(saved.to_json())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            # The round goes on; only a restart in its middle would start a new attempt.
            log.warning("could not save round %d's attempt for a restart: %s", saved.round, exc)

    def load(self) -> SavedAttempt | None:
        if self.path is None:
            return None
        try:
            if self.path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"over {MAX_FILE_BYTES} bytes")
            return SavedAttempt.from_json(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring %s (a new attempt starts instead): %s", self.path, exc)
            return None

    def clear(self) -> None:
        if self.path is not None:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not remove %s: %s", self.path, exc)


def why_not(saved: SavedAttempt, run_id: str, number: int, kind: int, model_digest: str,
            deadline_s: float, now: float | None = None) -> str | None:
    """Why `saved` cannot be reopened as round `number` (None: it can)."""
    now = time.time() if now is None else now
    if saved.run_id != run_id or saved.round != number or saved.kind != kind:
        return f"it was round {saved.round} of run {saved.run_id}"
    if not model_digest or saved.model_digest != model_digest:
        return "the global model is not the one it sent"
    if now > saved.deadline + deadline_s:
        return f"it is {now - saved.deadline:.0f}s past its deadline"
    return None


def reopenable(plan: Plan, job: Job) -> bool:
    """Only a plain star training round is reopened: a secure round's masks, a ring's
    rendezvous and an async step's buffer do not survive the aggregator's memory."""
    return type(plan) is StarPlan and job.secure_aggregation is None


class Reopener:
    """What the round engine asks: save each attempt it opens, and after a restart the saved
    one to reopen (once, for the round it belongs to)."""

    def __init__(self, directory: Path | None) -> None:
        self.file = AttemptFile(directory)
        self.saved: SavedAttempt | None = None

    def restored(self) -> None:
        self.saved = self.file.load()

    def opened(self, run_id: str, rnd: RoundState, chosen: list[Node], plan: Plan, job: Job,
               model_digest: str) -> None:
        if self.file.path is None or not reopenable(plan, job):
            return
        tasks = {n.name: rnd.task_ids[n.node_id] for n in chosen}
        self.file.save(SavedAttempt(run_id, rnd.number, rnd.attempt, rnd.kind, model_digest,
                                    rnd.deadline, time.time(), tasks))

    def take(self, run_id: str, number: int, plan: Plan, job: Job,
             model_digest: Callable[[], str]) -> SavedAttempt | None:
        """The saved attempt of round `number`, if it can be reopened."""
        saved, self.saved = self.saved, None
        if saved is None or not reopenable(plan, job):
            return None
        why = why_not(saved, run_id, number, plan.kind, model_digest(), job.round_deadline_s)
        if why is not None:
            log.info("round %d: not reopening attempt %d saved before the restart (%s); a new "
                     "attempt starts", number, saved.attempt, why)
            return None
        return saved

    @staticmethod
    async def gather(saved: SavedAttempt, pool: list[Node], connected: Callable[[], list[Node]],
                     deadline_s: float) -> list[Node]:
        """The connected sites once all of the saved attempt's sites are back, or GATHER_S
        (at most half a round deadline) has passed: sites register again one by one after a
        restart, and one left out would lose the update it sent before the kill."""
        loop = asyncio.get_running_loop()
        end = loop.time() + min(GATHER_S, deadline_s / 2)
        while not set(saved.tasks) <= {n.name for n in pool} and loop.time() < end:
            await asyncio.sleep(0.25)
            pool = connected()
        return pool

    @staticmethod
    def sites(saved: SavedAttempt, pool: list[Node], required: int) -> list[Node] | None:
        """The saved attempt's sites among the connected ones (registered again after the
        restart, under new node ids); None when too few came back to reopen it."""
        nodes = [n for n in pool if n.name in saved.tasks]
        if len(nodes) < required:
            log.info("round %d: not reopening attempt %d saved before the restart (%d of its %d "
                     "sites are back, %d needed); a new attempt starts", saved.round,
                     saved.attempt, len(nodes), len(saved.tasks), required)
            return None
        log.info("round %d: reopening attempt %d after the restart: the same model and the same "
                 "tasks for its %d sites, which send again the updates they kept", saved.round,
                 saved.attempt, len(nodes))
        return nodes

    def finished(self) -> None:
        self.file.clear()
