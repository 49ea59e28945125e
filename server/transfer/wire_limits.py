"""Bounds on every string, list and map a node sends, checked before any of it is kept.

What the aggregator stores from the wire ends up in its memory, its log, state.json and the
admin documents: a 9 MiB error text made `fedgpu rounds --json` exceed the gRPC message
limit, 10,000 labels took a megabyte per registration, and a node name with a newline forged
a log line. Names are printable text of bounded length, maps and lists have a bounded number
of bounded entries, numbers are finite, and a failure's error text is truncated with a marker
(it is the one free-form text worth keeping even when long).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from fedgpu.core.constants import BUNDLE_STATES, TASK_APPROVALS
from fedgpu.core.fedstats.wire import MAX_DOC_BYTES
from fedgpu.core.site_policy import MAX_POLICY_BYTES
from fedgpu.proto import pb
from fedgpu.server.rejections import Reject

MAX_NAME = 128          # node names
MAX_TEXT = 1024         # any other string: versions, GPU names, reasons, ids
MAX_ITEMS = 256         # entries of any list or map not named below (GPUs, tasks, warnings)
MAX_LABELS = 32
MAX_LABEL_KEY = 64
MAX_LABEL_VALUE = 256
MAX_METRICS = 64        # entries of train_metrics / eval_metrics
MAX_METRIC_NAME = 64
MAX_ERROR = 4096        # a failure report's error text, kept up to this many characters
MAX_SERIES = 100_000    # iteration_loss values (ring mode; the block's own length is checked too)
MAX_STATE = 32          # a heartbeat's state word

_FLOATS = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


@dataclass
class WireError(ValueError):
    """A message outside the bounds; `reason` is the refusal counter it belongs to."""

    message: str
    reason: Reject = Reject.MALFORMED

    def __str__(self) -> str:
        return self.message


def shown(text: str, limit: int = 80) -> str:
    """`text` quoted for an error message or a log line: escaped and cut short."""
    q = repr(text[:limit])
    return q + (f" (+{len(text) - limit} more characters)" if len(text) > limit else "")


def check_text(text: str, what: str, limit: int = MAX_TEXT) -> str:
    if len(text) > limit:
        raise WireError(f"{what} is {len(text)} characters long; at most {limit} are allowed")
    if not text.isprintable():
        # Control characters (newlines, ANSI escapes) would forge lines in the log.
        raise WireError(f"{what} {shown(text)} holds control or non-printable characters")
    return text


def truncate(text: str, limit: int = MAX_ERROR) -> str:
    """Free-form text kept within `limit` characters, control characters escaped, with a
    marker saying how long it was."""
    clean = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    if len(text) <= limit and len(clean) <= limit:
        return clean
    return f"{clean[:limit]} [truncated: {len(text)} characters in all]"


def check_message(msg: Message, where: str, skip: frozenset[str] = frozenset()) -> None:
    """Every string, list, map and number in `msg` (recursively) within the general bounds;
    fields named in `skip` are the caller's to check."""
    for field, value in msg.ListFields():
        if field.name in skip:
            continue
        path = f"{where}.{field.name}"
        is_map = (field.message_type is not None
                  and field.message_type.GetOptions().map_entry)
        if is_map or field.is_repeated:
            if len(value) > MAX_ITEMS:
                raise WireError(f"{path} has {len(value)} entries; at most {MAX_ITEMS}")
            if is_map:
                for k, v in value.items():
                    _check_value(field.message_type.fields_by_name["value"], v, f"{path}[{k!r}]")
                    if isinstance(k, str):
                        check_text(k, f"a key of {path}")
            else:
                for i, v in enumerate(value):
                    _check_value(field, v, f"{path}[{i}]")
        else:
            _check_value(field, value, path)


def _check_value(field: FieldDescriptor, value: object, path: str) -> None:
    if isinstance(value, Message):
        check_message(value, path)
    elif isinstance(value, str):
        check_text(value, path)
    elif field.type in _FLOATS and not math.isfinite(value):  # type: ignore[arg-type]
        raise WireError(f"{path} is {value}: numbers must be finite", Reject.NON_FINITE)


def check_registration(req: pb.RegisterRequest) -> str:
    """The node's name, once the whole request is within bounds."""
    name = req.node_name.strip()
    if not name:
        raise WireError("node_name must not be empty")
    check_text(name, "node_name", MAX_NAME)
    if len(req.labels) > MAX_LABELS:
        raise WireError(f"{len(req.labels)} labels; at most {MAX_LABELS} are allowed")
    for key, value in req.labels.items():
        check_text(key, "a label name", MAX_LABEL_KEY)
        check_text(value, f"label {key!r}", MAX_LABEL_VALUE)
    check_message(req, "RegisterRequest",
                  skip=frozenset({"node_name", "labels", "site_policy_json"}))
    # The site's policy is parsed (strictly, bounded) where it is read: federation_service.
    if len(req.site_policy_json) > MAX_POLICY_BYTES:
        raise WireError(f"site_policy_json is over {MAX_POLICY_BYTES} bytes")
    if req.task_approval and req.task_approval not in TASK_APPROVALS:
        raise WireError(f"task_approval {shown(req.task_approval)} is not one of "
                        f"{', '.join(TASK_APPROVALS)}")
    return name


def check_heartbeat(req: pb.HeartbeatRequest) -> None:
    check_text(req.state, "state", MAX_STATE)
    check_message(req, "HeartbeatRequest")
    for status in req.bundles:
        if status.state not in BUNDLE_STATES:
            raise WireError(f"bundle state {shown(status.state)} is not one of "
                            f"{', '.join(BUNDLE_STATES)}")


def check_update_header(header: pb.UpdateHeader) -> None:
    """An update's header within bounds, metrics finite. Truncates `error` in place."""
    for name in ("train_metrics", "eval_metrics"):
        metrics = getattr(header, name)
        if len(metrics) > MAX_METRICS:
            raise WireError(f"{name} has {len(metrics)} entries; at most {MAX_METRICS}")
        for key, value in metrics.items():
            check_text(key, f"a key of {name}", MAX_METRIC_NAME)
            if not math.isfinite(value):
                # Strict JSON has no NaN or Infinity: such a metric would break every
                # `--json` document that shows it.
                raise WireError(f"{name}[{key!r}] is {value}: metrics must be finite numbers",
                                Reject.NON_FINITE)
    if len(header.iteration_loss) > MAX_SERIES:
        raise WireError(f"iteration_loss has {len(header.iteration_loss)} values; at most "
                        f"{MAX_SERIES}")
    if not all(math.isfinite(v) for v in header.iteration_loss):
        raise WireError("iteration_loss holds NaN or Infinity: losses must be finite",
                        Reject.NON_FINITE)
    header.error = truncate(header.error)
    header.ineligible_reason = truncate(header.ineligible_reason, MAX_TEXT)
    # A site's statistics document (mode = "statistics"); its content is read by
    # fedgpu/core/fedstats/wire.py, with its own checks, when the answer is accepted.
    if len(header.statistics_json) > MAX_DOC_BYTES:
        raise WireError(f"statistics_json has {len(header.statistics_json)} characters; at "
                        f"most {MAX_DOC_BYTES}")
    check_message(header, "UpdateHeader", skip=frozenset(
        {"train_metrics", "eval_metrics", "iteration_loss", "error", "ineligible_reason",
         "statistics_json"}))
