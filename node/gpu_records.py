"""What NVML told us, as frozen records: the agent's decisions, the wire and `fedgpu devices`
all read these, never the driver's objects. No NVML here, so the aggregator can read a node's
report with the same types.

A GPU in MIG mode cannot be given to CUDA whole: its MIG devices (GPU instance + compute
instance) are what a process can use, each named by its own `MIG-...` UUID. So a snapshot
lists physical GPUs (as before), each carrying its MIG devices, and `training_devices` is
the one place that says what a round may train on: MIG devices in place of their GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MIB = 1024 * 1024


@dataclass(frozen=True)
class ProcessRecord:
    pid: int
    used_mib: int | None


@dataclass(frozen=True)
class MigPlacement:
    """Where a MIG device sits: its GPU and its NVML MIG index and instance ids."""

    parent_index: int
    parent_uuid: str
    mig_index: int
    gpu_instance_id: int | None
    compute_instance_id: int | None


@dataclass(frozen=True)
class GpuRecord:
    """A physical GPU, or (``mig`` set) one MIG device of one; ``index`` is then its GPU's."""

    index: int
    uuid: str
    name: str
    memory_total_mib: int | None
    memory_used_mib: int | None
    memory_free_mib: int | None
    utilization_pct: int | None
    compute_capability: str | None
    processes: tuple[ProcessRecord, ...]
    healthy: bool
    reason: str
    # MIG, for a physical GPU: True/False as NVML reports the current mode, None where it
    # cannot say (no MIG on this board: NotSupported); mig_reason says which and why.
    mig_mode: bool | None = None
    mig_reason: str = ""
    mig_devices: tuple[GpuRecord, ...] = ()
    # Set on a MIG device only.
    mig: MigPlacement | None = None


@dataclass(frozen=True)
class NvmlSnapshot:
    available: bool
    reason: str
    driver_version: str | None
    cuda_driver_version: str | None
    gpus: tuple[GpuRecord, ...]


def training_devices(gpus: Iterable[GpuRecord]) -> tuple[GpuRecord, ...]:
    """What a round may train on: each GPU, or in its place its MIG devices when it is in MIG
    mode (a GPU in MIG mode is not a CUDA device itself; with no MIG device configured it
    offers nothing)."""
    out: list[GpuRecord] = []
    for g in gpus:
        out.extend(g.mig_devices if g.mig_mode else (g,))
    return tuple(out)


def label(g: GpuRecord) -> str:
    """How decisions and reasons name a device."""
    if g.mig is not None:
        return f"MIG device {g.mig.mig_index} of GPU {g.index} ({g.uuid})"
    return f"GPU {g.index} ({g.uuid or 'uuid unknown'})"


def has_room(g: GpuRecord, min_free_mib: int) -> bool:
    # Unknown free memory (NotSupported, e.g. unified-memory boards) cannot prove a
    # minimum, so it only qualifies when no minimum was asked for.
    if g.memory_free_mib is None:
        return min_free_mib == 0
    return g.memory_free_mib >= min_free_mib


def rank(g: GpuRecord) -> tuple[int, int, int]:
    """Sort key, best first: most free memory (unknown below any known amount, even 0 MiB),
    then the lower GPU index and MIG index, so the choice is stable between rounds."""
    free = -1 if g.memory_free_mib is None else g.memory_free_mib
    return (-free, g.index, -1 if g.mig is None else g.mig.mig_index)


def _mig_dict(m: MigPlacement | None) -> dict[str, Any] | None:
    if m is None:
        return None
    return {
        "parent_index": m.parent_index,
        "parent_uuid": m.parent_uuid,
        "mig_index": m.mig_index,
        "gpu_instance_id": m.gpu_instance_id,
        "compute_instance_id": m.compute_instance_id,
    }


def _gpu_dict(g: GpuRecord) -> dict[str, Any]:
    return {
        "index": g.index,
        "uuid": g.uuid,
        "name": g.name,
        "memory_total_mib": g.memory_total_mib,
        "memory_used_mib": g.memory_used_mib,
        "memory_free_mib": g.memory_free_mib,
        "utilization_pct": g.utilization_pct,
        "compute_capability": g.compute_capability,
        "processes": [{"pid": p.pid, "used_mib": p.used_mib} for p in g.processes],
        "healthy": g.healthy,
        "reason": g.reason,
        "mig_mode": g.mig_mode,
        "mig_reason": g.mig_reason,
        "mig_devices": [_gpu_dict(m) for m in g.mig_devices],
        "mig": _mig_dict(g.mig),
    }


def to_dict(snap: NvmlSnapshot) -> dict[str, Any]:
    """JSON-able form with stable keys (``fedgpu devices --json``, registration)."""
    return {
        "available": snap.available,
        "reason": snap.reason,
        "driver_version": snap.driver_version,
        "cuda_driver_version": snap.cuda_driver_version,
        "gpus": [_gpu_dict(g) for g in snap.gpus],
    }


_BASE_KEYS = ("index", "uuid", "name", "memory_total_mib", "memory_used_mib",
              "memory_free_mib", "utilization_pct", "compute_capability", "healthy", "reason")


def _gpu_from_dict(g: Mapping[str, Any]) -> GpuRecord:
    # The MIG keys are absent from reports of nodes older than MIG support.
    mig = g.get("mig")
    return GpuRecord(
        **{k: g[k] for k in _BASE_KEYS},
        processes=tuple(ProcessRecord(int(p["pid"]), p["used_mib"]) for p in g["processes"]),
        mig_mode=g.get("mig_mode"),
        mig_reason=str(g.get("mig_reason") or ""),
        mig_devices=tuple(_gpu_from_dict(m) for m in g.get("mig_devices") or ()),
        mig=None if mig is None else MigPlacement(**mig),
    )


def from_dict(data: Mapping[str, Any]) -> NvmlSnapshot:
    """Inverse of :func:`to_dict`, for the side that receives a node's report."""
    gpus = tuple(_gpu_from_dict(g) for g in data["gpus"])
    return NvmlSnapshot(
        available=bool(data["available"]),
        reason=str(data["reason"]),
        driver_version=data["driver_version"],
        cuda_driver_version=data["cuda_driver_version"],
        gpus=gpus,
    )
