"""Training updates kept on disk so they are sent again, never trained again.

A push that fails past its retries (the link stayed down, the aggregator refused to answer)
leaves the trained update here, in the node's state folder, named by its task. An update the
aggregator acknowledged is kept too, marked so: an aggregator killed before its round closed
reopens the same attempt when it restarts (server/rounds/reopen.py) and hands out the same
task again, because what it had accepted lived in its memory. When the aggregator hands out a
task the node kept an update for (same task id, same global model digest), the agent sends the
kept update instead of training once more. A task of a later attempt or round of the same job
means the aggregator moved on: the kept updates of that job's earlier tasks are dropped (and
the log says so). At most MAX_KEPT updates are kept, the oldest dropped first, and none older
than MAX_AGE_S. An acknowledged update is kept only when it can be moved here (its work folder
on the same file system as the node's state): a copy of every round's update would slow every
round for the sake of a restart.

Files per task: the UpdateHeader as protobuf bytes, the weights as the safetensors file the
round wrote (moved here, not copied, when on the same file system), and a small JSON note of
the task it answers (job, round, global model digest, acknowledged): nothing executable.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from fedgpu.core import digests
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node.unacked")

# Kept updates at once: a node answers one task at a time (two with two jobs), so more are
# left-overs; each holds a whole update on disk.
MAX_KEPT = 4
# An aggregator down for longer than this reopens nothing a site kept.
MAX_AGE_S = 24 * 3600.0
MAX_NOTE_BYTES = 64 << 10


@dataclass(frozen=True)
class Kept:
    header: pb.UpdateHeader
    weights: Path | None
    acked: bool = False


@dataclass(frozen=True)
class Note:
    """The task a kept update answers."""

    job_id: str
    round: int
    model_digest: str
    acked: bool

    @classmethod
    def of(cls, task: pb.TaskHeader, acked: bool) -> Note:
        return cls(task.job_terms.job_id, task.round, _model_digest(task), acked)


def _model_digest(task: pb.TaskHeader) -> str:
    try:
        return digests.of_header(task)[1]
    except digests.UnknownDigest:
        return ""


class UnackedUpdates:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _paths(self, task_id: str) -> tuple[Path, Path, Path]:
        # Task ids are the aggregator's hex strings; anything else is not kept.
        safe = "".join(c for c in task_id if c.isalnum() or c in "-_")[:128]
        return (self.folder / f"{safe}.header", self.folder / f"{safe}.safetensors",
                self.folder / f"{safe}.json")

    def keep(self, header: pb.UpdateHeader, weights: Path | None,
             task: pb.TaskHeader | None = None, acked: bool = False) -> None:
        """Keep `header` (and its weights, moved here) for `task`: until the aggregator moves
        on, and when not `acked`, until it acknowledges it."""
        if not header.task_id:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if acked and weights is not None and \
                    weights.stat().st_dev != self.folder.stat().st_dev:
                # A copy of the whole update after every round is too dear for a copy only a
                # killed aggregator would ask for: such a site trains again in that case.
                log.debug("not keeping the acknowledged update of task %s: its weights are on "
                          "another file system than %s", header.task_id, self.folder)
                return
            now = time.time()
            olds = sorted(self.folder.glob("*.header"), key=lambda p: p.stat().st_mtime)
            for n, old in enumerate(olds):
                if n < len(olds) - MAX_KEPT + 1 or now - old.stat().st_mtime > MAX_AGE_S:
                    self.drop(old.stem)
            head, body, note = self._paths(header.task_id)
            if weights is not None:
                shutil.move(str(weights), body)
            if task is not None:
                note.write_text(json.dumps(asdict(Note.of(task, acked))))
            head.write_bytes(header.SerializeToString())
        except OSError as exc:
            log.warning("could not keep the update for task %s: %s", header.task_id, exc)

    def acknowledged(self, task_id: str) -> None:
        """The aggregator acknowledged it: kept (for its restart) but never re-pushed unasked."""
        note = self._note(task_id)
        if note is not None:
            self._paths(task_id)[2].write_text(json.dumps({**asdict(note), "acked": True}))

    def _note(self, task_id: str) -> Note | None:
        path = self._paths(task_id)[2]
        try:
            if path.stat().st_size > MAX_NOTE_BYTES:
                return None
            doc = json.loads(path.read_text())
            return Note(str(doc["job_id"]), int(doc["round"]), str(doc["model_digest"]),
                        bool(doc["acked"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def take(self, task: pb.TaskHeader | str) -> Kept | None:
        """The update kept for `task` (a header; or its id alone), if any and if it answers
        the very model this task sends."""
        task_id = task if isinstance(task, str) else task.task_id
        head, body, _ = self._paths(task_id)
        try:
            header = pb.UpdateHeader.FromString(head.read_bytes())
        except (OSError, ValueError):
            return None
        note = self._note(task_id)
        if not isinstance(task, str) and note is not None and note.model_digest and \
                _model_digest(task) and note.model_digest != _model_digest(task):
            log.info("round %d: the update kept for task %s was made from another model; "
                     "dropped", task.round, task_id)
            self.drop(task_id)
            return None
        return Kept(header, body if body.exists() else None,
                    note.acked if note is not None else False)

    def moved_on(self, task: pb.TaskHeader) -> list[tuple[str, int]]:
        """A new task of a job: drop the updates kept for that job's earlier tasks (another
        attempt or an earlier round: the aggregator will never ask for them). Returns the
        (task id, round) of each dropped."""
        job = task.job_terms.job_id
        if not job or not self.folder.is_dir():
            return []
        dropped = []
        for head in self.folder.glob("*.header"):
            note = self._note(head.stem)
            if (head.stem != task.task_id and note is not None and note.job_id == job
                    and note.round <= task.round):
                self.drop(head.stem)
                dropped.append((head.stem, note.round))
        return dropped

    def drop(self, task_id: str) -> None:
        for path in self._paths(task_id):
            path.unlink(missing_ok=True)


def answer_from_kept(unacked: UnackedUpdates, header: pb.TaskHeader, node_id: str,
                     push: Callable[[pb.TaskHeader, pb.UpdateHeader, Path | None], bool]
                     ) -> bool:
    """Answer `header` with the update this site kept for it, if any (True: answered, nothing
    trains); first drop the updates of attempts the aggregator has moved on from."""
    kept = unacked.take(header)
    if kept is not None:
        log.info("round %d: sending again the update kept for task %s (not training again)",
                 header.round, header.task_id)
        # Under the id this node has now: an aggregator restart made it register again.
        kept.header.node_id = node_id or kept.header.node_id
        if push(header, kept.header, kept.weights):
            # Still kept: an aggregator restarted before the round closed asks again.
            unacked.acknowledged(header.task_id)
        return True
    for task_id, old in unacked.moved_on(header):
        log.info("the aggregator moved on (round %d, task %s): dropping the update kept for "
                 "task %s of round %d, which it will not ask for again", header.round,
                 header.task_id, task_id, old)
    return False
