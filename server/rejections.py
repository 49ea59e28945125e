"""Why an update is refused, defined once below everything that refuses one: the round engine
(server/rounds/), the upload paths (server/transfer/) and the gRPC glue all raise and answer
with these, so none of them imports another for its reasons."""

from __future__ import annotations

from enum import StrEnum

import grpc


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


class UpdateRejected(Exception):
    """An update that must not be aggregated; `reason` is its counter key."""

    def __init__(self, reason: Reject, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# The status each refusal is answered with, by gRPC and by the bulk port alike; anything
# else is INVALID_ARGUMENT.
STATUS_OF: dict[Reject, grpc.StatusCode] = {
    Reject.LATE: grpc.StatusCode.FAILED_PRECONDITION,
    Reject.STALE_ROUND: grpc.StatusCode.FAILED_PRECONDITION,
    Reject.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    Reject.NOT_SELECTED: grpc.StatusCode.PERMISSION_DENIED,
    Reject.WRONG_TASK: grpc.StatusCode.PERMISSION_DENIED,
    Reject.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reject.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
}
