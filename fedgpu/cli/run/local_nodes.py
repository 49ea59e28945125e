"""The node processes of `fedgpu run`: one worker factory and a few `node start-many` hosts.

A host process costs ~60-100 MB whatever number of nodes it hosts, and an idle node costs a
thread and a connection; the factory holds the one copy of torch. So 100 local nodes are one
factory and two host processes, not 100 agents and 100 idle round workers.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from fedgpu.core.datasets import NODE_DIR_PREFIX

FACTORY_SOCKET = "factory.sock"


@dataclass(frozen=True)
class Host:
    """One agent process: nodes first .. first+count-1."""

    first: int
    count: int

    @property
    def name(self) -> str:
        last = self.first + self.count - 1
        return f"nodes-{self.first}" + (f"-{last}" if last != self.first else "")


def hosts(nodes: int, per_process: int) -> list[Host]:
    """`nodes` spread evenly over as few processes as `per_process` allows."""
    procs = max(1, math.ceil(nodes / max(1, per_process)))
    base, extra = divmod(nodes, procs)
    out, first = [], 1
    for i in range(procs):
        count = base + (1 if i < extra else 0)
        out.append(Host(first, count))
        first += count
    return out


def factory_cmd(socket: Path, cpu_slots: int) -> list[str]:
    # Not through the CLI: the factory must start lean and single-threaded (node/rounds/factory.py).
    return [sys.executable, "-m", "fedgpu.node.rounds.factory", "--socket", str(socket),
            "--cpu-slots", str(cpu_slots)]


def host_cmd(host: Host, *, address: str, split: Path, socket: Path, logs: Path, gpu: str,
             torch_threads: int, gpu_memory_fraction: float | None,
             ring_ports: list[int] | None, policy: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "fedgpu.cli.app", "node", "start-many",
           "--aggregator", address, "--split", str(split), "--first", str(host.first),
           "--count", str(host.count), "--name-prefix", NODE_DIR_PREFIX, "--gpu", gpu,
           "--torch-threads", str(torch_threads), "--worker-factory", str(socket),
           "--status-dir", str(logs), "--log-dir", str(logs),
           # A local demo runs the bundles its own job brings (the agents log it loudly);
           # their cache lives with the run's logs, not in the user's state directory.
           "--task-approval", "any", "--state-dir", str(logs / "node-state")]
    if gpu_memory_fraction is not None:
        cmd += ["--gpu-memory-fraction", str(gpu_memory_fraction)]
    if policy is not None:  # --cross-site: the nodes share their local models
        cmd += ["--policy", str(policy)]
    if ring_ports:
        # Any node may be rank 0 and host the rendezvous: each gets a port of its own.
        ports = ring_ports[host.first - 1:host.first - 1 + host.count]
        cmd += ["--ring-host", "127.0.0.1", "--ring-ports", ",".join(map(str, ports))]
    return cmd
