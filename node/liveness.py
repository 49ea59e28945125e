"""What the agent's heartbeat carries besides "alive": the task it works on and its GPUs' free
memory now; and what the reply may say back: that task is no longer wanted (its job was
stopped, its round closed), so the round's worker is killed instead of training to the end
for an update the aggregator would refuse.

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
        self._task_id = ""
        self._cancel: threading.Event | None = None

    def working_on(self, task_id: str) -> threading.Event:
        """Note the task now running; the event is set when the aggregator abandons it."""
        cancel = threading.Event()
        with self._lock:
            self._task_id, self._cancel = task_id, cancel
        return cancel

    def done(self) -> None:
        with self._lock:
            self._task_id, self._cancel = "", None

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
        with self._lock:
            task_id = self._task_id
        req = pb.HeartbeatRequest(node_id=node_id, state=state, task_id=task_id,
                                  capacity=self.capacity(), bundles=bundles)
        try:
            reply = self.client.heartbeat(req, timeout=timeout)
        except grpc.RpcError:
            return None
        if reply.abandon and task_id:
            with self._lock:
                if self._task_id == task_id and self._cancel is not None:
                    if not self._cancel.is_set():
                        log.warning("the aggregator no longer wants task %s (its job was "
                                    "stopped or its round closed): abandoning it", task_id)
                    self._cancel.set()
        return reply
