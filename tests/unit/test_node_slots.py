"""A node with several slots (`fedgpu node start --slots N`), its parts without processes:
GPU admission beside the other slots' tasks (node/gpu_admission.py, plain NVML records),
the slots' loops (node/task_slots.py) and the heartbeat's account of every task in hand
(node/liveness.py, against a real aggregator's Heartbeat on loopback is
tests/integration/test_slots.py's).

Threat model: none beyond correctness: two jobs on one GPU must both fit the site's memory
policy (a second task must not be admitted on memory the first was admitted to but has not
yet allocated), and a slot that fails must not leave the agent half-running.
"""

from __future__ import annotations

import threading

import pytest

from fedgpu.core import slots
from fedgpu.core.constants import GpuNeed
from fedgpu.core.job.resources import Resources
from fedgpu.node.gpu_admission import GpuAdmission
from fedgpu.node.gpu_records import GpuRecord, NvmlSnapshot
from fedgpu.node.liveness import Liveness
from fedgpu.node.policy import Ineligible, parse_gpu_flags
from fedgpu.node.task_slots import TaskSlots
from fedgpu.proto import pb


def _card(free: int, total: int = 16000) -> NvmlSnapshot:
    gpu = GpuRecord(0, "GPU-0000", "Test", total, total - free, free, 0, "8.0", (), True, "ok")
    return NvmlSnapshot(True, "NVML sees 1 GPU", "550", "12.4", (gpu,))


def test_two_jobs_on_one_gpu_must_both_fit_its_memory_policy() -> None:
    gpus = GpuAdmission(parse_gpu_flags("offer", None, 0, None))
    need = Resources(GpuNeed.REQUIRED, 6000)
    # The first job's task is admitted on the card's 10000 MiB free and holds its 6000.
    first, _ = gpus.admit("task-1", need, False, _card(10000))
    assert first.device == "cuda" and gpus.held() == {"GPU-0000": 6000}
    # Its worker has not allocated yet (NVML still shows 10000 free): the second job's task
    # sees 4000, not 10000, and is refused with the reason and what the other task holds.
    with pytest.raises(Ineligible) as refused:
        gpus.admit("task-2", need, False, _card(10000))
    assert "no GPU has 6000 MiB free" in str(refused.value)
    assert "other running tasks hold 6000 MiB of GPU-0000" in str(refused.value)
    # A smaller job fits beside it; once the first ends, the larger one fits again.
    small, _ = gpus.admit("task-3", Resources(GpuNeed.REQUIRED, 3000), False, _card(10000))
    assert small.device == "cuda"
    gpus.release("task-1")
    gpus.release("task-3")
    assert gpus.held() == {}
    again, _ = gpus.admit("task-2", need, False, _card(10000))
    assert again.device == "cuda"


def test_a_memory_fraction_holds_its_share_of_the_card() -> None:
    # --gpu-memory-fraction 0.5: each task may use half the card; a third finds no room.
    gpus = GpuAdmission(parse_gpu_flags("offer", None, 1000, 0.5))
    need = Resources(GpuNeed.REQUIRED, 0)
    for task in ("a", "b"):
        gpus.admit(task, need, False, _card(16000))
    assert gpus.held() == {"GPU-0000": 16000}
    with pytest.raises(Ineligible, match="other running tasks hold 16000 MiB"):
        gpus.admit("c", need, False, _card(16000))


def test_a_cpu_task_holds_no_gpu_memory() -> None:
    gpus = GpuAdmission(parse_gpu_flags("none", None, 0, None))
    decision, _ = gpus.admit("t", Resources(GpuNeed.NONE, 0), False, _card(100))
    assert decision.device == "cpu" and gpus.held() == {}


def test_the_slots_run_side_by_side_and_one_ending_ends_them_all() -> None:
    stop = threading.Event()
    both = threading.Barrier(3, timeout=10)
    seen: list[int] = []

    def serve(slot: int) -> int:
        seen.append(slot)
        both.wait()  # every slot is running at once, or this times out
        if slot == 2:
            raise RuntimeError("slot 2 broke")
        stop.wait(10)
        return 0

    with pytest.raises(RuntimeError, match="slot 2 broke"):
        TaskSlots(3, serve, stop, stop.set).run()
    assert sorted(seen) == [0, 1, 2] and stop.is_set()


def test_one_slot_runs_on_the_calling_thread() -> None:
    main = threading.get_ident()
    assert TaskSlots(1, lambda slot: int(threading.get_ident() == main), threading.Event(),
                     lambda: None).run() == 1


def test_advertised_slots_are_bounded() -> None:
    assert slots.advertised(0) == 1  # a node from before slots
    assert slots.advertised(3) == 3
    assert slots.advertised(10**6) == slots.MAX_SLOTS


class _Aggregator:
    """The heartbeat's other side: it no longer wants the tasks in `unwanted`."""

    def __init__(self, unwanted: set[str]) -> None:
        self.unwanted = unwanted
        self.sent: list[pb.HeartbeatRequest] = []

    def heartbeat(self, request: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatReply:
        self.sent.append(request)
        more = [t for t in request.more_task_ids if t in self.unwanted]
        return pb.HeartbeatReply(known=True, abandon=request.task_id in self.unwanted,
                                 abandon_task_ids=more)


def test_a_heartbeat_names_every_task_in_hand_and_abandons_only_the_unwanted() -> None:
    agg = _Aggregator({"job-b-task"})
    live = Liveness(agg, parse_gpu_flags("none", None, 0, None))  # type: ignore[arg-type]
    first, second = live.working_on("job-a-task"), live.working_on("job-b-task")
    assert live.beat("node-1", "training", timeout=1) is not None
    (sent,) = agg.sent
    assert (sent.task_id, list(sent.more_task_ids)) == ("job-a-task", ["job-b-task"])
    # The stopped job's task is cancelled; the other job's goes on.
    assert second.is_set() and not first.is_set()
    live.done("job-b-task")
    assert live.running() == ["job-a-task"]
