"""The open round's transfers, site by site (issue 37.4): what `fedgpu rounds` and the
dashboard's round view show while a round runs — each site's state, its measured link, and for a
transfer in flight its direction, the bytes done of its size, the rate and the time left.

Both directions are counted where the aggregator moves the bytes, on either path: a download as
it is sent (server/transfer/downloads.py), an upload as it lands (server/transfer/uploads.py).
A site whose download or upload ended in this round shows the rate it moved at (`last`).
"""

from __future__ import annotations

import time
from typing import Any

from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.states import SlotState
from fedgpu.server.transfer.downloads import Downloads


def open_round(orch: Orchestrator, uploads: Any, downloads: Downloads | None = None
               ) -> dict[str, Any] | None:
    """The `open` object of `fedgpu rounds --json`; None when no round is open."""
    rnd = orch.current
    if rnd is None or rnd.closed:
        return None
    now = time.time()
    flying: dict[str, tuple[int, int, float]] = (
        uploads.progress() if uploads is not None else {})
    downloads = downloads or Downloads()
    sending = downloads.in_flight()
    names = {n.node_id: n.name for n in orch.registry.all()}
    sites = []
    for node_id, state in sorted(rnd.slots.items()):
        name = names.get(node_id, node_id)
        link = orch.registry.links.get(name)
        entry: dict[str, Any] = {"node": name, "state": str(state)}
        if link is not None and link.at:
            entry["down_bytes_per_s"] = round(link.down, 1) or None
            entry["up_bytes_per_s"] = round(link.up, 1) or None
        if name in flying:
            got, size, seconds = flying[name]
            entry.update(phase="uploading", **_moving("up", got, size, got, seconds))
        elif (d := sending.get(name)) is not None:
            entry.update(phase="downloading", **_moving("down", d.done, d.size, d.sent,
                                                        d.seconds))
        elif node_id in rnd.upload_s:
            entry["last"] = _ended("up", rnd.upload_bytes.get(node_id, 0),
                                   rnd.upload_s[node_id])
        elif (d := downloads.last(name)) is not None \
                and d.ended_at >= rnd.started:
            if state == SlotState.ASSIGNED:
                entry["phase"] = "training"
            entry["last"] = _ended("down", d.size, d.seconds)
        sites.append(entry)
    return {"round": rnd.number, "attempt": rnd.attempt,
            "deadline_in_s": round(max(rnd.deadline - now, 0.0), 1), "sites": sites}


def _ended(direction: str, size: int, seconds: float) -> dict[str, Any]:
    """A site's last transfer of the round, ended: its size, time and the rate it moved at."""
    return {"direction": direction, "bytes": size, "seconds": round(seconds, 3),
            "rate_bytes_per_s": round(size / seconds, 1) if size and seconds > 0 else None}


def _moving(direction: str, done: int, size: int, moved: int, seconds: float
            ) -> dict[str, Any]:
    """A transfer in flight: `done` of `size` bytes, `moved` of them in `seconds` (a resumed
    transfer's rate counts only what this connection moved)."""
    rate = moved / seconds if seconds > 0 else 0.0
    return {"direction": direction, "bytes": done, "size": size,
            "rate_bytes_per_s": round(rate, 1) or None,
            "time_left_s": round((size - done) / rate, 1) if rate > 0 else None}
