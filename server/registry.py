"""Nodes the aggregator knows: identity, liveness, devices, GPU decision, last resources.

The registry outlives the aggregator's process (server/registry_store.py): after a restart the
nodes of the last run are listed as `lost`, with their last-seen time, until each registers
again; a node leaves it only when the operator retires it (`fedgpu nodes forget`, or
`fedgpu server stop --retire-nodes`), never because the aggregator stopped.

Two kinds of life: a node is *alive* while it heartbeats, and *available* for a round while its
task loop also polls (a PullTask in progress, or one within LOOP_GRACE_S): a site whose worker
loop is stuck still heartbeats, and must not be sampled and fail the round for everyone
(server/rounds/eligibility.py).
"""

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
from fedgpu.core.job.resources import Resources
from fedgpu.core.link_rates import SiteLink
from fedgpu.core.site_policy import SitePolicy
from fedgpu.server.registry_store import RegistryStore, SavedNode


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
    # The tasks assigned to this node and not yet answered, by the id of the job whose round
    # assigned each (several with --slots); re-served on a re-pull so a dropped stream loses
    # nothing (server/jobs/queue.py task_for).
    assigned: dict[str, Any] = field(default_factory=dict)
    # Round tasks the site runs at once, as it advertised them (fedgpu/core/slots.py): that
    # many running jobs may hold it (server/jobs/seats.py).
    slots: int = 1
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
    # The site's own policy as it advertised it at registration (None: it has none): the
    # aggregator samples by it; the node's own check decides (fedgpu/core/site_policy.py).
    site_policy: SitePolicy | None = None
    # Its own policy's last refusal of a job: (that job, until when it is believed, why).
    policy_refusal: tuple[Any, float, str] | None = None
    bundle_states: dict[str, tuple[str, str]] = field(default_factory=dict)
    # sha256 of the identity secret it registered with ("" from nodes that send none): who
    # may take this name over while the node is alive.
    identity: str = ""
    # Training speed it last reported per task (examples/s), for the estimate at submit
    # (server/jobs/estimate.py); at most MAX_THROUGHPUT_TASKS tasks, the oldest dropped.
    throughput: dict[str, float] = field(default_factory=dict)
    # A record of the last run, read back at start: listed (as lost), never used; the node
    # registers again when it comes back.
    restored: bool = False
    # Its task loop: PullTasks in progress now, and when one last began or ended or an update
    # came (None: not yet known, as for nodes made by hand in tests).
    polling: int = 0
    loop_seen: float | None = None
    # Why the last training round left it out (a slow link, server/rounds/link_admission.py):
    # told to the node with its next empty poll, for its log. None: it was not.
    left_out: str | None = None

    def loop_quiet_s(self, now: float) -> float:
        """Seconds since its task loop last asked for work (0 while it asks)."""
        if self.polling or self.loop_seen is None:
            return 0.0
        return max(0.0, now - self.loop_seen)

    def measured(self, task: str, examples_per_s: float) -> None:
        if not (math.isfinite(examples_per_s) and examples_per_s > 0):
            return
        self.throughput.pop(task, None)
        self.throughput[task] = examples_per_s
        while len(self.throughput) > MAX_THROUGHPUT_TASKS:
            del self.throughput[next(iter(self.throughput))]


MAX_THROUGHPUT_TASKS = 16
DEFAULT_MAX_NODES = 10_000
# A node whose task loop has not polled for this long is not sampled: its polls end every
# 15-30 s and it polls again at once, so only a busy (training) or stuck loop stays quiet.
LOOP_GRACE_S = 20.0


class RegistryFull(Exception):
    """No room for another node: every one registered is alive."""


class NameTaken(Exception):
    """A live node holds the name and the newcomer cannot prove it is that node."""


class NotForgotten(Exception):
    """`fedgpu nodes forget` of a node that is not known, or alive without force."""


class Retired(Exception):
    """A node the operator retired (`fedgpu nodes forget`) registers again with the same
    identity: it is told so, and exits."""


def identity_digest(secret: str) -> str:
    # Kept as a digest: the registry (and anything that dumps it) never holds the secret.
    return hashlib.sha256(secret.encode()).hexdigest() if secret else ""


class Registry:
    def __init__(self, heartbeat_interval_s: int = 5, clock: Callable[[], float] = time.time,
                 max_nodes: int = DEFAULT_MAX_NODES, store: RegistryStore | None = None
                 ) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self._clock = clock
        self.max_nodes = max_nodes
        self._nodes: dict[str, Node] = {}
        # Each site's measured link, by name: it outlives the site's reconnects (a new node
        # id), so a slow site is known as slow when it comes back (fedgpu/core/link_rates.py).
        self.links: dict[str, SiteLink] = {}
        self.changed = asyncio.Event()
        self._store = store
        if store is not None:
            for saved in store.load()[:max_nodes]:
                node = _restored(saved)
                self._nodes[node.node_id] = node

    def link(self, name: str) -> SiteLink:
        """The site's link record, made on first use; at most max_nodes kept (oldest go)."""
        found = self.links.get(name)
        if found is None:
            while len(self.links) >= self.max_nodes:
                del self.links[next(iter(self.links))]
            found = self.links[name] = SiteLink()
        return found

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
        retired_at = self._store.retired_at(name, digest) if self._store else None
        if retired_at is not None:
            raise Retired(
                f"node {name!r} was retired by the operator ('fedgpu nodes forget') at "
                f"{_clock_time(retired_at)}: this federation does not take it back. To "
                "bring the site back, start it under another --name (or with a fresh node "
                "state directory)")
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
            self._drop(old)
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
            # Its task loop starts now: one that never polls is not sampled for long.
            loop_seen=now,
        )
        self._nodes[node_id] = node
        self._save([node])
        self._notify()
        return node

    def find(self, query: str) -> Node:
        """The node `query` names: its name or id, or a unique prefix of one."""
        nodes = [n for n in self._nodes.values() if not n.gone]
        for exact in ([n for n in nodes if n.name == query],
                      [n for n in nodes if n.node_id == query]):
            if exact:
                return exact[0]
        found = [n for n in nodes if query and (n.name.startswith(query)
                                                or n.node_id.startswith(query))]
        if len(found) == 1:
            return found[0]
        if not found:
            raise NotForgotten(f"no node called {query!r} is registered")
        names = ", ".join(sorted(n.name for n in found)[:8])
        raise NotForgotten(f"{query!r} names {len(found)} nodes ({names}): give more of it")

    def forget(self, query: str, force: bool = False) -> Node:
        """Retire the node `query` names (find()): its record goes, and the node, which may no
        longer register with its identity, exits when it next calls (a lost one when it comes
        back). A live one only with `force`: a typo must not retire a working site."""
        node = self.find(query)
        if self.is_alive(node) and not force:
            raise NotForgotten(f"node {node.name!r} is alive (last seen "
                               f"{self._clock() - node.last_seen:.0f}s ago): stop it first, or "
                               "pass --force to retire it (it exits)")
        if self._store is not None:
            self._store.retire(node.name, node.identity, self._clock())
        self._drop(node)
        self._notify()
        return node

    def retire_all(self) -> None:
        """Every node is being told it is retired (`server stop --retire-nodes`, the end of
        `fedgpu run`): none is listed as lost at the next start."""
        if self._store is not None:
            self._store.clear()

    def flush(self) -> None:
        """Write every node's last-seen time (called every few seconds and at stop)."""
        self._save([n for n in self._nodes.values() if not n.gone and not n.restored])

    def _save(self, nodes: list[Node]) -> None:
        if self._store is not None:
            self._store.save([_saved(n) for n in nodes])

    def _drop(self, node: Node) -> None:
        node.gone = True
        node.wakeup.set()
        del self._nodes[node.node_id]
        if self._store is not None:
            self._store.remove(node.name)

    def _evict_one(self, now: float, name: str) -> None:
        # Room for a newcomer: the node lost the longest ago goes; with all of them alive the
        # registry is full for real.
        lost = [n for n in self._nodes.values() if not self.is_alive(n, now)]
        if not lost:
            raise RegistryFull(f"cannot register {name!r}: {len(self._nodes)} nodes are "
                               f"registered and alive, the most this aggregator takes "
                               "(--max-nodes)")
        self._drop(min(lost, key=lambda n: n.last_seen))

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
        return None if node is None or node.gone or node.restored else node

    def touch(self, node_id: str) -> Node | None:
        node = self.get(node_id)
        if node is not None:
            node.last_seen = self._clock()
        return node

    def is_alive(self, node: Node, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        # Three missed heartbeats: a node in a long poll or a long upload still beats.
        return (not node.gone and not node.restored
                and now - node.last_seen <= 3 * self.heartbeat_interval_s + 2)

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
                "last_seen_at": n.last_seen,
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
                "site_policy": n.site_policy.to_dict() if n.site_policy is not None else None,
                "stated_examples": n.stated_examples or None,
                "ring_endpoint": f"{n.ring_host or n.peer}:{n.ring_port}" if n.ring_port else None,
                "transport": n.transport,
                "bulk_error": n.bulk_error,
                "slots": n.slots,
            }
            for n in self.all()
        ]


def _clock_time(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def _saved(n: Node) -> SavedNode:
    return SavedNode(n.name, n.node_id, n.peer, n.version, n.registered_at, n.last_seen,
                     n.identity, {"labels": n.labels, "tasks": n.tasks, "devices": n.devices,
                                  "decision": n.decision, "rounds_completed": n.rounds_completed,
                                  "rounds_failed": n.rounds_failed, "last_round": n.last_round})


def _restored(s: SavedNode) -> Node:
    d = s.doc

    def typed(key: str, kind: type, default: Any) -> Any:
        value = d.get(key, default)
        return value if isinstance(value, kind) else default

    return Node(node_id=s.node_id, name=s.name, peer=s.peer, version=s.version,
                registered_at=s.registered_at, last_seen=s.last_seen,
                devices=typed("devices", dict, {}), decision=typed("decision", dict, {}),
                labels=typed("labels", dict, {}), tasks=typed("tasks", list, []),
                identity=s.identity, state="lost", restored=True,
                rounds_completed=typed("rounds_completed", int, 0),
                rounds_failed=typed("rounds_failed", int, 0),
                last_round=typed("last_round", int, None))
