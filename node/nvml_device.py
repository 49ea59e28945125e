"""One NVML device's fields, read into a record: the helpers node/nvml.py (whole GPUs) and
node/nvml_mig.py (MIG devices) share. Every pynvml call here takes the module as an
argument, so nothing imports pynvml at import time (see node/nvml.py).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from fedgpu.node.gpu_records import MIB, GpuRecord, MigPlacement, ProcessRecord

_T = TypeVar("_T")

LOST_HINT = "; the GPU fell off the bus (see dmesg for Xid 79): reset it (nvidia-smi -r) or reboot"


class DeviceFailed(Exception):
    """A device answered with a hard error: report it unhealthy, keep the others."""


def code_name(pynvml: ModuleType, err: BaseException) -> str:
    value = getattr(err, "value", None)
    for key, const in vars(pynvml).items():
        if key.startswith("NVML_ERROR_") and const == value:
            return key
    return f"NVML error {value}"


def soft_errors(pynvml: ModuleType) -> tuple[int, ...]:
    # These say "this field cannot be read here", not "this GPU is broken": e.g. memory
    # on unified-memory boards, process lists without host PID access, old drivers.
    return (
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    )


def field(pynvml: ModuleType, label: str, notes: list[str], read: Callable[[], _T]) -> _T | None:
    try:
        return read()
    except pynvml.NVMLError as err:
        if getattr(err, "value", None) in soft_errors(pynvml):
            notes.append(f"{label}: {err}")
            return None
        raise DeviceFailed(f"{label}: {err} ({code_name(pynvml, err)})") from err


def memory_info(pynvml: ModuleType, handle: Any) -> Any:
    # The v2 struct reports driver-reserved memory apart from "used", matching what
    # nvidia-smi shows; drivers older than r510 only have v1 (where used = total - free).
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    except pynvml.NVMLError as err:
        fallback = (
            pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
            pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
        )
        if getattr(err, "value", None) not in fallback:
            raise
    return pynvml.nvmlDeviceGetMemoryInfo(handle)


def _processes(pynvml: ModuleType, handle: Any) -> tuple[ProcessRecord, ...]:
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    records = (
        ProcessRecord(
            pid=int(p.pid),
            used_mib=None if p.usedGpuMemory is None else int(p.usedGpuMemory) // MIB,
        )
        for p in procs
    )
    return tuple(sorted(records, key=lambda r: r.pid))


def read_device(
    pynvml: ModuleType, get_handle: Callable[[], Any], index: int, mig: MigPlacement | None = None
) -> tuple[GpuRecord, Any]:
    """The record of one device (a GPU, or with ``mig`` a MIG device of GPU ``index``) and
    its handle; the handle is None when the device failed (the record then says why)."""
    notes: list[str] = []
    uuid, name = "", ""
    try:
        try:
            handle = get_handle()
        except pynvml.NVMLError as err:
            raise DeviceFailed(f"handle: {err} ({code_name(pynvml, err)})") from err
        uuid = field(pynvml, "uuid", notes, lambda: pynvml.nvmlDeviceGetUUID(handle)) or ""
        name = field(pynvml, "name", notes, lambda: pynvml.nvmlDeviceGetName(handle)) or ""
        mem = field(pynvml, "memory", notes, lambda: memory_info(pynvml, handle))
        # NVML has no utilization per MIG device (NotSupported on every board): not asked,
        # so each MIG device's reason does not repeat it.
        util = None if mig is not None else field(
            pynvml, "utilization", notes, lambda: pynvml.nvmlDeviceGetUtilizationRates(handle)
        )
        cc = field(
            pynvml,
            "compute capability",
            notes,
            lambda: pynvml.nvmlDeviceGetCudaComputeCapability(handle),
        )
        procs = field(pynvml, "processes", notes, lambda: _processes(pynvml, handle))
    except DeviceFailed as failed:
        record = GpuRecord(
            index=index,
            uuid=uuid,
            name=name,
            memory_total_mib=None,
            memory_used_mib=None,
            memory_free_mib=None,
            utilization_pct=None,
            compute_capability=None,
            processes=(),
            healthy=False,
            reason=f"unhealthy: {failed}" + (LOST_HINT if "GPU_IS_LOST" in str(failed) else ""),
            mig=mig,
        )
        return record, None
    record = GpuRecord(
        index=index,
        uuid=uuid,
        name=name,
        memory_total_mib=None if mem is None else int(mem.total) // MIB,
        memory_used_mib=None if mem is None else int(mem.used) // MIB,
        memory_free_mib=None if mem is None else int(mem.free) // MIB,
        utilization_pct=None if util is None else int(util.gpu),
        compute_capability=None if cc is None else f"{cc[0]}.{cc[1]}",
        processes=procs or (),
        healthy=True,
        reason="ok" if not notes else "ok; " + "; ".join(notes),
        mig=mig,
    )
    return record, handle
