"""What the agent's heartbeat carries besides "alive": the tasks it works on (one per busy
slot, `--slots`) and its GPUs' free memory now; and what the reply may say back: a task is no
longer wanted (its job was stopped, its round closed), so that round's worker is killed instead
of training to the end for an update the aggregator would refuse. The other tasks go on.

The capacity is read from NVML at every beat (a site with `--gpu none` never reads it: its
answer does not depend on its GPUs), so the aggregator samples rounds by free memory now, with
the same rule (fedgpu/core/admission.py) the node applies when the task comes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import grpc

from fedgpu.core.admission_wire import capacity_to_wire
from fedgpu.node import nvml, policy
from fedgpu.node.client import AggregatorClient
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node")


def cut_off(exc: BaseException, stop: threading.Event) -> bool:
    """A call the aggregator cut off as it stopped (not our own client closing under it): an
    aggregator restarting, so ask again."""
    return (not stop.is_set() and isinstance(exc, grpc.RpcError)
            and exc.code() == grpc.StatusCode.CANCELLED)


class Liveness:
    def __init__(self, client: AggregatorClient, flags: policy.GpuFlags) -> None:
        self.client = client
        self.flags = flags
        self._lock = threading.Lock()
        # The tasks running now, oldest first, each with the event that cancels it.
        self._tasks: dict[str, threading.Event] = {}

    def working_on(self, task_id: str) -> threading.Event:
        """Note a task now running; the event is set when the aggregator abandons it."""
        cancel = threading.Event()
        with self._lock:
            self._tasks[task_id] = cancel
        return cancel

    def done(self, task_id: str) -> None:
        with self._lock:
            self._tasks.pop(task_id, None)

    def running(self) -> list[str]:
        """The tasks in hand (the pulls of the other slots name them: not served again)."""
        with self._lock:
            return list(self._tasks)

    def capacity(self, snapshot: nvml.NvmlSnapshot | None = None) -> pb.NodeCapacity:
        """This node's policy and its GPUs' free memory (from `snapshot`, else read now)."""
        if snapshot is None:
            if self.flags.mode == "none":
                snapshot = nvml.NvmlSnapshot(False, "not read: --gpu none", None, None, ())
            else:
                snapshot = nvml.snapshot()
        return capacity_to_wire(policy.capacity(snapshot, self.flags))

    def beat(self, node_id: str, state: str, timeout: float,
             bundles: Sequence[pb.BundleStatus] = ()) -> pb.HeartbeatReply | None:
        """One heartbeat; None when it did not get through. An abandoned task is cancelled
        here, if it is still the one running."""
        ids = self.running()
        req = pb.HeartbeatRequest(node_id=node_id, state=state, task_id=ids[0] if ids else "",
                                  more_task_ids=ids[1:], capacity=self.capacity(),
                                  bundles=bundles)
        try:
            reply = self.client.heartbeat(req, timeout=timeout)
        except grpc.RpcError:
            return None
        dropped = set(reply.abandon_task_ids) & set(ids[1:])
        if reply.abandon and ids:
            dropped.add(ids[0])
        with self._lock:
            for task_id in sorted(dropped):
                cancel = self._tasks.get(task_id)
                if cancel is None:
                    continue  # it ended meanwhile
                if not cancel.is_set():
                    log.warning("the aggregator no longer wants task %s (its job was "
                                "stopped or its round closed): abandoning it", task_id)
                cancel.set()
        return reply
