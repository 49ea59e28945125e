"""Per-site slots: how many round tasks one site runs at once (`fedgpu node start --slots N`).

The node advertises its slots at registration; the aggregator lets that many running jobs hold
the site at once (server/jobs/seats.py), and the node runs that many round workers side by side
(node/task_slots.py). Both sides read the number through `advertised`, so a node from before
slots (which sends 0) counts as one slot, and no node can claim more than MAX_SLOTS.
"""

from __future__ import annotations

# A bound on what a node may claim: each slot is a round worker process and a pending task
# the aggregator keeps for it; a site claiming thousands would only hold jobs it cannot run.
MAX_SLOTS = 64
DEFAULT_SLOTS = 1


def advertised(slots: int) -> int:
    """The slots a node's registration stands for: 0 (a node from before slots) is one."""
    if slots <= 0:
        return DEFAULT_SLOTS
    return min(slots, MAX_SLOTS)

