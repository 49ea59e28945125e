"""The aggregator's own states, defined once. (Run states and round statuses, which the CLI
reads too, live in fedgpu.core.constants; why an update is refused in server/rejections.py.)"""

from __future__ import annotations

from enum import StrEnum


class SlotState(StrEnum):
    """One selected node's part in one round attempt."""

    ASSIGNED = "assigned"   # task handed out, no answer yet
    UPLOADING = "uploading"  # one stream of its answer claimed the slot and is being received
    ACCEPTED = "accepted"   # its update is in the aggregate
    FAILED = "failed"       # it reported that the round failed on its side
    REJECTED = "rejected"   # its answer was refused; its part in the attempt is over
    DROPPED = "dropped"     # no answer by the deadline
    INELIGIBLE = "ineligible"  # it cannot take the job now (its GPUs, its policy): no fault
