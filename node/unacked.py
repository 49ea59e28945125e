"""Updates the aggregator has not acknowledged yet, kept on disk so they are sent again, never
trained again.

A push that fails past its retries (the link stayed down, the aggregator refused to answer)
leaves the trained update here, in the node's state folder, named by its task. When the
aggregator hands out that same task again (its round is still open and it still waits for
this node), the agent sends the kept update instead of downloading and training once more.
An acknowledgement, or a task that is no longer offered, lets it go. The header is stored as
protobuf bytes and the weights as the safetensors file the round wrote: nothing executable.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node.unacked")

# Kept updates at once: a node answers one task at a time, so more are left-overs.
MAX_KEPT = 4


@dataclass(frozen=True)
class Kept:
    header: pb.UpdateHeader
    weights: Path | None


class UnackedUpdates:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _paths(self, task_id: str) -> tuple[Path, Path]:
        # Task ids are the aggregator's hex strings; anything else is not kept.
        safe = "".join(c for c in task_id if c.isalnum() or c in "-_")[:128]
        return self.folder / f"{safe}.header", self.folder / f"{safe}.safetensors"

    def keep(self, header: pb.UpdateHeader, weights: Path | None) -> None:
        """Keep `header` (and its weights, moved here) until acknowledged."""
        if not header.task_id:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for old in sorted(self.folder.glob("*.header"),
                              key=lambda p: p.stat().st_mtime)[:-MAX_KEPT + 1 or None]:
                self.drop(old.stem)
            head, body = self._paths(header.task_id)
            if weights is not None:
                shutil.move(str(weights), body)
            head.write_bytes(header.SerializeToString())
        except OSError as exc:
            log.warning("could not keep the unacknowledged update for task %s: %s",
                        header.task_id, exc)

    def take(self, task_id: str) -> Kept | None:
        """The update kept for `task_id`, if any."""
        head, body = self._paths(task_id)
        try:
            header = pb.UpdateHeader.FromString(head.read_bytes())
        except (OSError, ValueError):
            return None
        return Kept(header, body if body.exists() else None)

    def drop(self, task_id: str) -> None:
        for path in self._paths(task_id):
            path.unlink(missing_ok=True)
