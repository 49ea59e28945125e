"""MIG through NVML: whether a GPU is in MIG mode, its MIG devices as records, and a handle
for a MIG UUID.

A GPU in MIG mode is split into GPU instances, each with compute instances; one (GPU
instance, compute instance) pair is a MIG device, the unit CUDA can be given
(CUDA_VISIBLE_DEVICES=MIG-<uuid>). Every NVML error on these calls becomes a reason on the
GPU's record (NotSupported on boards without MIG, FUNCTION_NOT_FOUND on old drivers), never
an exception: MIG is an optional part of what a node reports.
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType
from typing import Any

from fedgpu.node.gpu_records import GpuRecord, MigPlacement
from fedgpu.node.nvml_device import code_name, read_device, soft_errors

# NVML allows 7 MIG devices per GPU today (A100/H100); the walk is bounded all the same.
MAX_MIG_DEVICES = 16

NO_INSTANCES = (
    "MIG mode is on but no MIG device is configured, so this GPU offers nothing to train on: "
    "create GPU and compute instances (nvidia-smi mig -cgi <profile> -C) or turn MIG off "
    "(nvidia-smi -mig 0)"
)


def _err(pynvml: ModuleType, err: BaseException) -> str:
    return f"{err} ({code_name(pynvml, err)})"


def _instance_id(pynvml: ModuleType, read: Any, handle: Any) -> int | None:
    try:
        return int(read(handle))
    except pynvml.NVMLError:
        return None


def _mig_devices(
    pynvml: ModuleType, handle: Any, gpu: GpuRecord
) -> tuple[tuple[GpuRecord, ...], list[str]]:
    notes: list[str] = []
    try:
        count = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except pynvml.NVMLError as err:
        return (), [f"MIG devices cannot be listed: {_err(pynvml, err)}"]
    devices: list[GpuRecord] = []
    for j in range(min(count, MAX_MIG_DEVICES)):
        try:
            mig_handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
        except pynvml.NVMLError as err:
            # NOT_FOUND: no MIG device at this index (fewer than the maximum are configured).
            if getattr(err, "value", None) != pynvml.NVML_ERROR_NOT_FOUND:
                notes.append(f"MIG device {j}: {_err(pynvml, err)}")
            continue
        placement = MigPlacement(
            parent_index=gpu.index,
            parent_uuid=gpu.uuid,
            mig_index=j,
            gpu_instance_id=_instance_id(pynvml, pynvml.nvmlDeviceGetGpuInstanceId, mig_handle),
            compute_instance_id=_instance_id(
                pynvml, pynvml.nvmlDeviceGetComputeInstanceId, mig_handle
            ),
        )
        record, _ = read_device(pynvml, lambda h=mig_handle: h, gpu.index, placement)
        devices.append(record)
    return tuple(devices), notes


def with_mig(pynvml: ModuleType, handle: Any, gpu: GpuRecord) -> GpuRecord:
    """``gpu`` with its MIG mode, MIG devices and the reason for either filled in."""
    try:
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError as err:
        if getattr(err, "value", None) in soft_errors(pynvml):
            why = f"MIG not available on this GPU or driver: {err}"
        else:
            why = f"MIG mode cannot be read, the GPU is used whole: {_err(pynvml, err)}"
        return replace(gpu, mig_mode=None, mig_reason=why)
    later = ""
    if bool(pending) != bool(current):
        later = f"; MIG mode turns {'on' if pending else 'off'} at the next GPU reset"
    if not current:
        return replace(gpu, mig_mode=False, mig_reason="MIG mode off" + later)
    devices, notes = _mig_devices(pynvml, handle, gpu)
    if devices:
        n = len(devices)
        why = f"MIG mode on: {n} MIG device{'s' if n != 1 else ''}, trained on in its place"
    else:
        why = NO_INSTANCES
    return replace(
        gpu, mig_mode=True, mig_devices=devices, mig_reason="; ".join([why + later, *notes])
    )


def _walk_for(pynvml: ModuleType, uuid: str) -> Any | None:
    # Drivers before R470 resolve only GPU UUIDs: look at every MIG device of every GPU.
    for i in range(int(pynvml.nvmlDeviceGetCount())):
        try:
            gpu = pynvml.nvmlDeviceGetHandleByIndex(i)
            if not pynvml.nvmlDeviceGetMigMode(gpu)[0]:
                continue
            count = min(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)), MAX_MIG_DEVICES)
        except pynvml.NVMLError:
            continue
        for j in range(count):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, j)
                if pynvml.nvmlDeviceGetUUID(mig) == uuid:
                    return mig
            except pynvml.NVMLError:
                continue
    return None


def handle_by_uuid(pynvml: ModuleType, uuid: str) -> Any:
    """NVML's handle for a GPU or MIG UUID; raises pynvml.NVMLError as NVML does."""
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except pynvml.NVMLError as err:
        unresolved = (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not uuid.upper().startswith("MIG-") or getattr(err, "value", None) not in unresolved:
            raise
        found = _walk_for(pynvml, uuid)
        if found is None:
            raise
        return found
