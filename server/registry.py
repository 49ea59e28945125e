"""Nodes the aggregator knows: identity, liveness, devices, GPU decision, last resources."""

from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedgpu.core.admission import SiteCapacity
from fedgpu.core.config import Resources


@dataclass
class Node:
    node_id: str
    name: str
    peer: str
    version: str
    registered_at: float
    last_seen: float
    devices: dict[str, Any]
    decision: dict[str, Any]
    labels: dict[str, str]
    tasks: list[str]
    state: str = "idle"
    rounds_completed: int = 0
    rounds_failed: int = 0
    last_round: int | None = None
    last_resources: dict[str, Any] | None = None
    last_error: str | None = None
    # The task assigned to this node and not yet answered; re-served on a re-pull so a
    # dropped stream loses nothing.
    pending: Any = None
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    gone: bool = False
    # Ring mode: where peers reach this node's worker when it hosts the rendezvous (rank 0).
    ring_host: str = ""
    ring_port: int = 0
    # Training examples the node stated (at registration, or with its first training
    # update); 0 while unstated. Updates may not claim more.
    stated_examples: int = 0
    # How the node's last payload moved (either way), and why it uses gRPC although the
    # aggregator has a bulk port (it said it cannot reach it); None until known / when fine.
    transport: str | None = None
    bulk_error: str | None = None
    # Its GPU policy and free memory as it last reported them (None: it reports none), and
    # its own last "ineligible" answer: (what that job needed, why), until it reports again.
    capacity: SiteCapacity | None = None
    refusal: tuple[Resources, str] | None = None
    # Which code from the wire the node's site runs (TaskApproval; "" from older nodes), and
    # its latest answer about each offered bundle: sha256 -> (BundleState, reason).
    task_approval: str = ""
    bundle_states: dict[str, tuple[str, str]] = field(default_factory=dict)
    # sha256 of the identity secret it registered with ("" from nodes that send none): who
    # may take this name over while the node is alive.
    identity: str = ""
    # Training speed it last reported per task (examples/s), for the estimate at submit
    # (server/jobs/estimate.py); at most MAX_THROUGHPUT_TASKS tasks, the oldest dropped.
    throughput: dict[str, float] = field(default_factory=dict)

    def measured(self, task: str, examples_per_s: float) -> None:
        if not (math.isfinite(examples_per_s) and examples_per_s > 0):
            return
        self.throughput.pop(task, None)
        self.throughput[task] = examples_per_s
        while len(self.throughput) > MAX_THROUGHPUT_TASKS:
            del self.throughput[next(iter(self.throughput))]


MAX_THROUGHPUT_TASKS = 16
DEFAULT_MAX_NODES = 10_000


class RegistryFull(Exception):
    """No room for another node: every one registered is alive."""


class NameTaken(Exception):
    """A live node holds the name and the newcomer cannot prove it is that node."""


class NotForgotten(Exception):
    """`fedgpu nodes forget` of a node that is not known, or alive without force."""


def identity_digest(secret: str) -> str:
    # Kept as a digest: the registry (and anything that dumps it) never holds the secret.
    return hashlib.sha256(secret.encode()).hexdigest() if secret else ""


class Registry:
    def __init__(self, heartbeat_interval_s: int = 5, clock: Callable[[], float] = time.time,
                 max_nodes: int = DEFAULT_MAX_NODES) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self._clock = clock
        self.max_nodes = max_nodes
        self._nodes: dict[str, Node] = {}
        self.changed = asyncio.Event()

    def __len__(self) -> int:
        """Node records held (replaced ones are dropped, not kept)."""
        return len(self._nodes)

    def register(
        self,
        name: str,
        peer: str,
        version: str,
        devices: dict[str, Any],
        decision: dict[str, Any],
        labels: dict[str, str],
        tasks: list[str],
        identity: str = "",
    ) -> Node:
        now = self._clock()
        digest = identity_digest(identity)
        # A second agent started under a live node's name would evict it, and the evicted
        # one, re-registering, would evict the newcomer in turn, forever: only the same node
        # (the same identity from its state directory) may take a live name over.
        for old in self._nodes.values():
            if (old.name == name and self.is_alive(old, now) and old.identity and digest
                    and old.identity != digest):
                raise NameTaken(
                    f"node name {name!r} is held by a live node (from {old.peer}, last seen "
                    f"{now - old.last_seen:.0f}s ago) with another identity: give this node "
                    f"its own --name, or stop the other one; a node gone for good is removed "
                    f"with 'fedgpu nodes forget {name}'")
        # A node that comes back under its name (restart, reconnect) replaces its old self:
        # the old id can no longer push or pull, and its record goes (a name re-registered
        # in a loop must not grow the registry).
        for old in [n for n in self._nodes.values() if n.name == name]:
            old.gone = True
            old.wakeup.set()
            del self._nodes[old.node_id]
        if len(self._nodes) >= self.max_nodes:
            self._evict_one(now, name)
        node_id = f"{name}-{secrets.token_hex(4)}"
        node = Node(
            node_id=node_id,
            name=name,
            peer=peer,
            version=version,
            registered_at=now,
            last_seen=now,
            devices=devices,
            decision=decision,
            labels=labels,
            tasks=tasks,
            identity=digest,
        )
        self._nodes[node_id] = node
        self._notify()
        return node

    def forget(self, name: str, force: bool = False) -> Node:
        """Remove the record of the node called `name`; a live one only with `force` (it then
        hears that it is unknown, and registers again)."""
        found = [n for n in self._nodes.values() if n.name == name and not n.gone]
        if not found:
            raise NotForgotten(f"no node called {name!r} is registered")
        node = found[0]
        if self.is_alive(node) and not force:
            raise NotForgotten(f"node {name!r} is alive (last seen "
                               f"{self._clock() - node.last_seen:.0f}s ago): stop it first, or "
                               "pass --force")
        node.gone = True
        node.wakeup.set()
        del self._nodes[node.node_id]
        self._notify()
        return node

    def _evict_one(self, now: float, name: str) -> None:
        # Room for a newcomer: the node lost the longest ago goes; with all of them alive the
        # registry is full for real.
        lost = [n for n in self._nodes.values() if not self.is_alive(n, now)]
        if not lost:
            raise RegistryFull(f"cannot register {name!r}: {len(self._nodes)} nodes are "
                               f"registered and alive, the most this aggregator takes "
                               "(--max-nodes)")
        oldest = min(lost, key=lambda n: n.last_seen)
        oldest.gone = True
        oldest.wakeup.set()
        del self._nodes[oldest.node_id]

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def report_capacity(self, node: Node, capacity: SiteCapacity) -> None:
        """A node's GPUs as they are now: its last "ineligible" answer is superseded (it is
        asked again), and a round waiting for nodes that can take its job looks again."""
        node.refusal = None
        if capacity != node.capacity:
            node.capacity = capacity
            self._notify()

    def get(self, node_id: str) -> Node | None:
        node = self._nodes.get(node_id)
        return None if node is None or node.gone else node

    def touch(self, node_id: str) -> Node | None:
        node = self.get(node_id)
        if node is not None:
            node.last_seen = self._clock()
        return node

    def is_alive(self, node: Node, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        # Three missed heartbeats: a node in a long poll or a long upload still beats.
        return not node.gone and now - node.last_seen <= 3 * self.heartbeat_interval_s + 2

    def alive(self) -> list[Node]:
        now = self._clock()
        return sorted(
            (n for n in self._nodes.values() if self.is_alive(n, now)), key=lambda n: n.node_id
        )

    def all(self) -> list[Node]:
        return sorted((n for n in self._nodes.values() if not n.gone), key=lambda n: n.name)

    def snapshot(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [
            {
                "node_id": n.node_id,
                "name": n.name,
                "address": n.peer,
                "version": n.version,
                "alive": self.is_alive(n, now),
                "state": n.state if self.is_alive(n, now) else "lost",
                "last_seen_s": round(now - n.last_seen, 3),
                "registered_at": n.registered_at,
                "rounds_completed": n.rounds_completed,
                "rounds_failed": n.rounds_failed,
                "last_round": n.last_round,
                "last_error": n.last_error,
                "gpu_decision": n.decision,
                "devices": n.devices,
                "last_resources": n.last_resources,
                "labels": n.labels,
                "tasks": n.tasks,
                "task_approval": n.task_approval or None,
                "stated_examples": n.stated_examples or None,
                "ring_endpoint": f"{n.ring_host or n.peer}:{n.ring_port}" if n.ring_port else None,
                "transport": n.transport,
                "bulk_error": n.bulk_error,
            }
            for n in self.all()
        ]
