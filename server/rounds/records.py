"""The round history as records: what admin, metrics, the checkpoint and (through
`fedgpu rounds --json`) the report, watch and the launcher read.

Each record's `to_dict()` is the JSON document docs/reference/json.md shows, key for key and in the
same order; `from_dict()` reads it back from the state store (or an older version's
state.json, which held the history), with defaults for keys older records lack. Keys a round or
update record does not know (written by another version) are kept in `extra` and written back
unchanged after the known ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from fedgpu.proto import pb
from fedgpu.server.strategies.aggregate import weighted_metric


def _extra(cls: type, d: Mapping[str, Any]) -> dict[str, Any]:
    known = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k not in known}


# A data-parallel update lists at most this many devices (the job file's limit on workers): a
# node cannot grow the round history without bound by listing more.
MAX_DEVICES = 1024


def _opt(v: int) -> int | None:
    return None if v < 0 else int(v)


@dataclass
class Resources:
    """What one round used on a node, as the node measured it (MiB, seconds)."""

    device: str = ""
    gpu_uuid: str | None = None
    nvml_used_before_mib: int | None = None
    nvml_used_peak_mib: int | None = None
    nvml_used_after_mib: int | None = None
    torch_peak_allocated_mib: int | None = None
    torch_peak_reserved_mib: int | None = None
    rss_peak_mib: int | None = None
    train_seconds: float = 0.0
    round_seconds: float = 0.0
    # The node's wait for a slot of its host's worker factory (part of round_seconds); None
    # only in a record resumed from a state.json written before nodes reported it, whose
    # documents stay as they were.
    queued_seconds: float | None = None
    # Device time of the round: its training time on each device, summed (a data-parallel
    # round's workers each count); GPU-hours per site and job add these up. None only in a
    # record from before nodes reported it (its documents stay as they were).
    device_seconds: float | None = None
    # A data-parallel round's devices, rank 0 first: {"rank", "device", "gpu_uuid",
    # "nvml_used_before_mib", "nvml_used_peak_mib", "nvml_used_after_mib", "train_seconds"}.
    devices: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_wire(cls, r: pb.RoundResources) -> Resources:
        # The wire says -1 for "not measured"; the documents say null.
        return cls(
            device=r.device,
            gpu_uuid=r.gpu_uuid or None,
            nvml_used_before_mib=_opt(r.nvml_used_before_mib),
            nvml_used_peak_mib=_opt(r.nvml_used_peak_mib),
            nvml_used_after_mib=_opt(r.nvml_used_after_mib),
            torch_peak_allocated_mib=_opt(r.torch_peak_allocated_mib),
            torch_peak_reserved_mib=_opt(r.torch_peak_reserved_mib),
            rss_peak_mib=_opt(r.rss_peak_mib),
            train_seconds=round(r.train_seconds, 3),
            round_seconds=round(r.round_seconds, 3),
            queued_seconds=round(r.queued_seconds, 3),
            # A node from before device_seconds: its training time on its one device.
            device_seconds=round(r.device_seconds or r.train_seconds, 3),
            devices=[{"rank": d.rank, "device": d.device, "gpu_uuid": d.gpu_uuid or None,
                      "nvml_used_before_mib": _opt(d.nvml_used_before_mib),
                      "nvml_used_peak_mib": _opt(d.nvml_used_peak_mib),
                      "nvml_used_after_mib": _opt(d.nvml_used_after_mib),
                      "train_seconds": round(d.train_seconds, 3)}
                     for d in r.devices[:MAX_DEVICES]],
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["queued_seconds"] is None:
            del d["queued_seconds"]
        if d["device_seconds"] is None:
            del d["device_seconds"]
        if not d["devices"]:  # one device: the keys above describe it
            del d["devices"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Resources:
        d = d or {}
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class UpdateRecord:
    """One accepted update."""

    node_id: str
    node: str
    num_examples: int
    train_metrics: dict[str, float]
    eval_metrics: dict[str, float]
    num_eval_examples: int
    resources: Resources
    upload_s: float | None
    gpu_decision: dict[str, Any]
    # Ring mode: the training loss of each iteration of the block.
    iteration_loss: list[float] | None = None
    # The path the payload came by ("bulk" or "grpc"); None in records from before it was
    # kept, whose documents stay as they were.
    transport: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "node_id": self.node_id,
            "node": self.node,
            "num_examples": self.num_examples,
            "train_metrics": self.train_metrics,
            "eval_metrics": self.eval_metrics,
            "num_eval_examples": self.num_eval_examples,
            "resources": self.resources.to_dict(),
            "upload_s": self.upload_s,
            "gpu_decision": self.gpu_decision,
        }
        if self.transport is not None:
            d["transport"] = self.transport
        if self.iteration_loss is not None:
            d["iteration_loss"] = self.iteration_loss
        return {**d, **self.extra}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> UpdateRecord:
        return cls(
            node_id=d.get("node_id", ""), node=d.get("node", ""),
            num_examples=d.get("num_examples", 0),
            train_metrics=dict(d.get("train_metrics") or {}),
            eval_metrics=dict(d.get("eval_metrics") or {}),
            num_eval_examples=d.get("num_eval_examples", 0),
            resources=Resources.from_dict(d.get("resources")),
            upload_s=d.get("upload_s"), gpu_decision=d.get("gpu_decision") or {},
            iteration_loss=d.get("iteration_loss"), transport=d.get("transport"),
            extra=_extra(cls, d),
        )


@dataclass
class Rejection:
    """A refused update that names a round (node fields None for an unknown node id)."""

    node_id: str | None
    node: str | None
    round: int | None
    reason: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Rejection:
        return cls(d.get("node_id"), d.get("node"), d.get("round"), d.get("reason", ""),
                   d.get("message", ""))


# Refusals listed per round; more are only counted: anyone holding the token could otherwise
# grow a round's record (and state.json) without bound by sending refused updates.
MAX_LISTED_REJECTIONS = 100


class _HasRejections(Protocol):
    rejected: list[Rejection]
    rejected_not_listed: int


def list_rejection(owner: _HasRejections, entry: Rejection) -> None:
    if len(owner.rejected) < MAX_LISTED_REJECTIONS:
        owner.rejected.append(entry)
    else:
        owner.rejected_not_listed += 1


@dataclass
class Failure:
    """A node's report that the round failed on its side."""

    node_id: str
    node: str
    error: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Failure:
        return cls(d.get("node_id", ""), d.get("node", ""), d.get("error", ""))


@dataclass
class Ineligibility:
    """A node's answer that it cannot take the job now (its GPUs, its policy), not a fault."""

    node_id: str
    node: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Ineligibility:
        return cls(d.get("node_id", ""), d.get("node", ""), d.get("reason", ""))


@dataclass
class EvalEntry:
    node_id: str
    node: str
    num_examples: int
    metrics: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EvalEntry:
        return cls(d.get("node_id", ""), d.get("node", ""), d.get("num_examples", 0),
                   dict(d.get("metrics") or {}))


@dataclass
class EvalSummary:
    """The federated evaluation of one global model: per node, and weighted by examples."""

    per_node: list[EvalEntry] = field(default_factory=list)
    loss: float | None = None
    accuracy: float | None = None
    num_examples: int = 0
    nodes: int = 0

    def add(self, entry: EvalEntry) -> None:
        self.per_node.append(entry)
        for metric in ("loss", "accuracy"):
            setattr(self, metric, weighted_metric(
                [(e.metrics[metric], e.num_examples) for e in self.per_node
                 if metric in e.metrics]))
        self.num_examples = sum(e.num_examples for e in self.per_node)
        self.nodes = len(self.per_node)

    def to_dict(self) -> dict[str, Any]:
        return {"per_node": [e.to_dict() for e in self.per_node], "loss": self.loss,
                "accuracy": self.accuracy, "num_examples": self.num_examples,
                "nodes": self.nodes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> EvalSummary | None:
        if d is None:
            return None
        return cls([EvalEntry.from_dict(e) for e in d.get("per_node") or []], d.get("loss"),
                   d.get("accuracy"), d.get("num_examples", 0), d.get("nodes", 0))


@dataclass
class RingInfo:
    """Ring mode: what one block of iterations was and how it went."""

    first_iteration: int
    iterations: int
    local_steps: int
    ranks: list[str]
    restart: bool
    backend: str | None
    consensus_distance: float | None
    bytes_sent_per_worker_per_iteration: float | None
    iteration_loss: list[float]
    error: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> RingInfo | None:
        if d is None:
            return None
        return cls(**{f.name: d.get(f.name) for f in fields(cls)})


@dataclass
class RoundRecord:
    """One closed round attempt."""

    round: int
    attempt: int
    status: str
    started_at: float
    duration_s: float
    participants: list[str]
    nodes_reporting: int
    dropped: list[str]
    train_loss: float | None
    num_examples: int
    bytes_received: int
    aggregation_s: float
    updates: list[UpdateRecord] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    # Refusals beyond the first MAX_LISTED_REJECTIONS naming this round: counted, not listed.
    rejected_not_listed: int = 0
    # The federated evaluation of the model this round produced (arrives with the next round).
    eval: EvalSummary | None = None
    # Why a round with enough updates was still retried (its result was not finite).
    error: str | None = None
    ring: RingInfo | None = None
    # Selected nodes that answered they cannot take the job now; listed only when there are.
    ineligible: list[Ineligibility] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "round": self.round,
            "attempt": self.attempt,
            "status": self.status,
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "participants": self.participants,
            "nodes_reporting": self.nodes_reporting,
            "dropped": self.dropped,
            "train_loss": self.train_loss,
            "num_examples": self.num_examples,
            "bytes_received": self.bytes_received,
            "aggregation_s": self.aggregation_s,
            "updates": [u.to_dict() for u in self.updates],
            "rejected": [r.to_dict() for r in self.rejected],
            "failures": [f.to_dict() for f in self.failures],
            "eval": None if self.eval is None else self.eval.to_dict(),
        }
        if self.rejected_not_listed:
            d["rejected_not_listed"] = self.rejected_not_listed
        if self.error is not None:
            d["error"] = self.error
        if self.ring is not None:
            d["ring"] = self.ring.to_dict()
        if self.ineligible:
            d["ineligible"] = [i.to_dict() for i in self.ineligible]
        return {**d, **self.extra}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RoundRecord:
        return cls(
            round=int(d["round"]), attempt=d.get("attempt", 1),
            status=d.get("status", "finished"), started_at=d.get("started_at", 0.0),
            duration_s=d.get("duration_s", 0.0), participants=list(d.get("participants") or []),
            nodes_reporting=d.get("nodes_reporting", 0), dropped=list(d.get("dropped") or []),
            train_loss=d.get("train_loss"), num_examples=d.get("num_examples", 0),
            bytes_received=d.get("bytes_received", 0), aggregation_s=d.get("aggregation_s", 0.0),
            updates=[UpdateRecord.from_dict(u) for u in d.get("updates") or []],
            rejected=[Rejection.from_dict(r) for r in d.get("rejected") or []],
            failures=[Failure.from_dict(f) for f in d.get("failures") or []],
            rejected_not_listed=d.get("rejected_not_listed", 0),
            eval=EvalSummary.from_dict(d.get("eval")), error=d.get("error"),
            ring=RingInfo.from_dict(d.get("ring")),
            ineligible=[Ineligibility.from_dict(i) for i in d.get("ineligible") or []],
            extra=_extra(cls, d),
        )
