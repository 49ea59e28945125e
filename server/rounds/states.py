"""The aggregator's own states and reasons, defined once. (Run states and round statuses,
which the CLI reads too, live in fedgpu.core.constants.)"""

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


class Reject(StrEnum):
    """Why an update was refused: the counter keys of `status --json` `rejections` and the
    `reason` of `rounds --json` `rejected` entries (docs/reference/json.md lists them)."""

    UNKNOWN_NODE = "unknown_node"
    STALE_ROUND = "stale_round"
    LATE = "late"
    NOT_SELECTED = "not_selected"
    WRONG_TASK = "wrong_task"
    DUPLICATE = "duplicate"
    WRONG_KIND = "wrong_kind"
    NUM_EXAMPLES = "num_examples"
    TOO_LARGE = "too_large"
    TRUNCATED = "truncated"
    DIGEST = "digest"
    MALFORMED = "malformed"
    NAMES = "names"
    SHAPE = "shape"
    DTYPE = "dtype"
    NON_FINITE = "non_finite"
    TIMEOUT = "timeout"      # the upload stalled or outlived its round's deadline
