"""The open round's transfers, site by site (issue 37.4): what `fedgpu rounds` and the
dashboard's round view show while a round runs — each site's state, its measured link, and
for an upload in flight the bytes received, the rate and the time left.

Uploads are measured where the aggregator sees them (server/transfer/uploads.py, bytes as they
land, either path). A download is the node's: while a site holds its task the time left is
estimated from the model's size and the link rates the node reports (fedgpu/core/link_rates.py).
"""

from __future__ import annotations

import time
from typing import Any

from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.states import SlotState


def open_round(orch: Orchestrator, uploads: Any) -> dict[str, Any] | None:
    """The `open` object of `fedgpu rounds --json`; None when no round is open."""
    rnd = orch.current
    if rnd is None or rnd.closed:
        return None
    now = time.time()
    flying: dict[str, tuple[int, int, float]] = (
        uploads.progress() if uploads is not None else {})
    names = {n.node_id: n.name for n in orch.registry.all()}
    model_bytes = orch.payload_size
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
            rate = got / seconds if seconds > 0 else 0.0
            entry.update(phase="uploading", bytes=got, size=size,
                         rate_bytes_per_s=round(rate, 1) or None,
                         time_left_s=round((size - got) / rate, 1) if rate > 0 else None)
        elif state == SlotState.ASSIGNED and model_bytes and link is not None and link.down:
            left = model_bytes / link.down - (now - rnd.started)
            entry.update(phase="downloading" if left > 0 else "training", size=model_bytes,
                         time_left_s=round(max(left, 0.0), 1))
        sites.append(entry)
    return {"round": rnd.number, "attempt": rnd.attempt,
            "deadline_in_s": round(max(rnd.deadline - now, 0.0), 1), "sites": sites}

