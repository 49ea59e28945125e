"""What one node agent is told at start: where the aggregator is, its data, its GPU policy,
and the limits and retries of its calls (`fedgpu node start`'s flags, node/fleet.py's nodes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedgpu.core import tls
from fedgpu.core.constants import DEFAULT_RING_PORT, TaskApproval
from fedgpu.core.site_policy import SitePolicy
from fedgpu.node import policy


@dataclass
class AgentConfig:
    aggregator: str
    data_dir: Path
    # None: the first free default identity of the state directory (node/identity.py).
    name: str | None
    token: str | None
    gpu: policy.GpuFlags
    connect_timeout_s: float = 60.0
    poll_s: int = 25
    status_file: Path | None = None
    work_root: Path | None = None
    torch_threads: int | None = None
    # The largest task payload (global model) this node takes; the aggregator's own
    # per-update limit, sent at registration, applies too (the smaller wins).
    max_payload_bytes: int = 4 << 30
    # Fork each round's training process from a worker factory that imported torch ahead of
    # time (CUDA untouched); False: spawn a fresh `python -m fedgpu.node.rounds.worker` per round.
    prestart: bool = True
    # The socket of a factory this host's agents share; None: the agent starts its own.
    worker_factory: Path | None = None
    # Where round workers write their log (a file descriptor); None: where the agent does.
    worker_output: int | None = None
    tls: tls.TlsFiles | None = None
    # Ring mode: where peers reach this node's worker when it hosts the rendezvous (rank 0).
    ring_host: str = ""
    ring_port: int = DEFAULT_RING_PORT
    # Backoff of every retried call; the deadline differs per call site (see _policy).
    retry_base_s: float = 0.5
    retry_cap_s: float = 15.0
    # An update the aggregator cannot be reached for is useless once its round has closed.
    report_timeout_s: float = 120.0
    # Code from the wire (docs: tutorials/own-task.md): which bundles this site runs, and where its
    # allow-list and bundle cache live (None: node/approvals.py default_state_dir()).
    task_approval: TaskApproval = TaskApproval.INSTALLED
    state_dir: Path | None = None
    # Secure aggregation: the site's floor on a round's threshold, on top of the strict
    # majority of its shareholders (0: the majority only).
    secagg_min_threshold: int = 0
    # The site's own policy (fedgpu/core/site_policy.py, `--policy FILE`); None: none.
    site_policy: SitePolicy | None = None
    # Round tasks (of different jobs) run at once, advertised at registration (`--slots`).
    slots: int = 1
