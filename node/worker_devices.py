"""Admission for data-parallel rounds (`[resources] workers = N | "all"`): one Decision per
worker, rank 0 first, from the GPUs as they are now, or the refusal the aggregator is sent.

The rule is `device_choice.choose_devices` (the site's --gpu mode, its minimum free memory and
the job's, --gpu-index first, most free memory next; `offer` takes fewer only down to the job's
`min_workers`). A site that trains on its CPU runs `workers` gloo processes there ("all": one,
there being no devices to count).
"""

from __future__ import annotations

from dataclasses import replace

from fedgpu.core.constants import GpuNeed
from fedgpu.core.job.resources import ALL_WORKERS, Resources
from fedgpu.node.device_choice import DeviceRequest, choose_devices
from fedgpu.node.gpu_records import training_devices
from fedgpu.node.nvml import NvmlSnapshot
from fedgpu.node.policy import Decision, GpuFlags, Ineligible


def decisions_for(snapshot: NvmlSnapshot, flags: GpuFlags, need: Resources,
                  decision: Decision) -> tuple[Decision, ...]:
    """The workers' devices for a job that needs `need`; `decision` is policy.decide_for_job's
    (the one-device answer, which also says CPU or GPU). Raises Ineligible with the reason
    when the site cannot give the devices the job asks for."""
    if not need.many_workers:
        return (decision,)
    request = DeviceRequest(workers=need.workers,  # type: ignore[arg-type]
                            min_workers=need.min_workers, min_free_mib=need.min_gpu_free_mib)
    if decision.device == "cpu":
        count = 1 if need.workers == ALL_WORKERS else int(need.workers)
        return tuple(decision for _ in range(count))
    devices = training_devices(snapshot.gpus) if snapshot.available else ()
    choice = choose_devices(devices, flags, request,
                            job_use_gpu=need.gpu is not GpuNeed.NONE)
    if choice.refusal is not None:
        raise Ineligible(choice.refusal)
    if not choice.devices:  # offer without a usable GPU: the CPU, as for one device
        count = 1 if need.workers == ALL_WORKERS else int(need.workers)
        return tuple(decision for _ in range(count))
    warnings = (*decision.warnings, *choice.warnings)
    return tuple(replace(decision, gpu_index=d.index, gpu_uuid=d.uuid, gpu_name=d.name,
                         reason=choice.reason, warnings=warnings)
                 for d in choice.devices)
