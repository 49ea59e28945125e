"""The simulation's configuration and the statistics it writes (`fedgpu sim --stats`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedgpu.core.tls import TlsFiles


@dataclass
class SimConfig:
    aggregator: str
    token: str | None
    nodes: int
    prefix: str = "sim"
    start_index: int = 0
    params: int = 1_000_000
    tensors: int = 20
    poll_s: int = 25
    # Nodes that share one HTTP/2 connection; 1 = a connection per node, as real sites have.
    nodes_per_channel: int = 1
    # How long the first registration may wait for an aggregator that is not up yet.
    connect_timeout_s: float = 120.0
    # The agent's backoff (node/retry.py) after the aggregator went away: full jitter up to
    # the cap, so thousands of simulated nodes do not reconnect in the same second.
    retry_base_s: float = 0.5
    retry_cap_s: float = 15.0
    # How long an update waits for an aggregator that went away while it was being made.
    report_timeout_s: float = 120.0
    stats_file: Path | None = None
    # Send this safetensors file as every update, and keep no downloaded model.
    update_file: Path | None = None
    # TLS (mutual with a certificate) on gRPC and on the bulk port, as `fedgpu node start`.
    tls: TlsFiles | None = None


@dataclass
class SimStats:
    registered: int = 0
    register_seconds: float = 0.0
    tasks: dict[str, int] = field(default_factory=dict)
    pushes: list[dict[str, float]] = field(default_factory=list)
    pulls: list[dict[str, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # Why nodes fell back to gRPC (the bulk port could not be reached).
    bulk_errors: list[str] = field(default_factory=list)
    # Times a node lost the aggregator and got it back, and registered again after that.
    reconnects: int = 0
    reregistered: int = 0
    # Nodes whose task loop ended on its own (told the run is over, or an error no retry
    # can fix); not those stopped with the process.
    ended: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "registered": self.registered,
            "register_seconds": round(self.register_seconds, 3),
            "tasks": self.tasks,
            "pushes": self.pushes,
            "pulls": self.pulls,
            "errors": self.errors[:20],
            "bulk_errors": sorted(set(self.bulk_errors))[:20],
            "reconnects": self.reconnects,
            "reregistered": self.reregistered,
            "ended": self.ended,
        }

    def write(self, path: Path | None) -> None:
        if path is not None:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self.to_dict()))
            tmp.replace(path)
