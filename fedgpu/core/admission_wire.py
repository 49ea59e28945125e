"""Admission records (fedgpu/core/admission.py) to and from their wire messages: a job's
[resources] on the TaskHeader, a node's capacity on Register and Heartbeat. Both sides read
them, so both conversions live here, once."""

from __future__ import annotations

from fedgpu.core.admission import GpuFree, SiteCapacity
from fedgpu.core.constants import GPU_NEEDS, GpuMode, GpuNeed
from fedgpu.core.job.resources import ALL_WORKERS, MAX_GPU_MIB, MAX_WORKERS, Resources
from fedgpu.proto import pb

_MODES = tuple(m.value for m in GpuMode)


def _mib(value: int) -> int | None:
    # The wire says -1 for "not known".
    return None if value < 0 else int(value)


def resources_to_wire(r: Resources) -> pb.JobResources:
    return pb.JobResources(gpu=r.gpu.value, min_gpu_free_mib=r.min_gpu_free_mib,
                           gpu_memory_mib=r.gpu_memory_mib or 0,
                           workers=-1 if r.workers == ALL_WORKERS else int(r.workers),
                           min_workers=r.min_workers or 0)


def resources_from_wire(header: pb.TaskHeader) -> Resources:
    """The job's [resources] from a task; ValueError when the aggregator sent a need this node
    does not know. Without them (an older aggregator), use_gpu alone decides."""
    if not header.HasField("resources"):
        return Resources(gpu=GpuNeed.PREFERRED if header.use_gpu else GpuNeed.NONE)
    r = header.resources
    if r.gpu not in GPU_NEEDS:
        raise ValueError(f"the task asks for gpu = {r.gpu[:40]!r}; this node knows "
                         f"{', '.join(GPU_NEEDS)}")
    if not (0 <= r.min_gpu_free_mib <= MAX_GPU_MIB and 0 <= r.gpu_memory_mib <= MAX_GPU_MIB):
        raise ValueError("the task's [resources] figures are out of range")
    if not (-1 <= r.workers <= MAX_WORKERS and 0 <= r.min_workers <= MAX_WORKERS):
        raise ValueError("the task's [resources] workers are out of range")
    workers: int | str = ALL_WORKERS if r.workers == -1 else max(1, int(r.workers))
    return Resources(gpu=GpuNeed(r.gpu), min_gpu_free_mib=int(r.min_gpu_free_mib),
                     gpu_memory_mib=int(r.gpu_memory_mib) or None, workers=workers,
                     min_workers=int(r.min_workers) or None)


def capacity_to_wire(c: SiteCapacity) -> pb.NodeCapacity:
    return pb.NodeCapacity(
        gpu_mode=c.mode.value,
        gpu_min_free_mib=c.min_free_mib,
        nvml_available=c.nvml_available,
        nvml_reason=c.nvml_reason[:512],
        gpus=[pb.GpuInfo(index=g.index, uuid=g.uuid,
                         memory_free_mib=-1 if g.free_mib is None else g.free_mib,
                         memory_total_mib=-1 if g.total_mib is None else g.total_mib,
                         healthy=g.healthy) for g in c.gpus],
    )


def capacity_from_wire(msg: pb.NodeCapacity) -> SiteCapacity:
    """A node's reported capacity; ValueError names what is wrong with it."""
    if msg.gpu_mode not in _MODES:
        raise ValueError(f"capacity.gpu_mode must be one of {', '.join(_MODES)}, not "
                         f"{msg.gpu_mode[:40]!r}")
    if msg.gpu_min_free_mib < 0:
        raise ValueError("capacity.gpu_min_free_mib must not be negative")
    return SiteCapacity(
        mode=GpuMode(msg.gpu_mode),
        min_free_mib=int(msg.gpu_min_free_mib),
        nvml_available=msg.nvml_available,
        nvml_reason=msg.nvml_reason,
        gpus=tuple(GpuFree(int(g.index), g.uuid, _mib(g.memory_free_mib),
                           _mib(g.memory_total_mib), g.healthy) for g in msg.gpus),
    )
