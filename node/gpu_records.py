"""What NVML told us, as frozen records: the agent's decisions, the wire and `fedgpu devices`
all read these, never the driver's objects. No NVML here, so the aggregator can read a node's
report with the same types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIB = 1024 * 1024


@dataclass(frozen=True)
class ProcessRecord:
    pid: int
    used_mib: int | None


@dataclass(frozen=True)
class GpuRecord:
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


@dataclass(frozen=True)
class NvmlSnapshot:
    available: bool
    reason: str
    driver_version: str | None
    cuda_driver_version: str | None
    gpus: tuple[GpuRecord, ...]


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


def from_dict(data: Mapping[str, Any]) -> NvmlSnapshot:
    """Inverse of :func:`to_dict`, for the side that receives a node's report."""
    gpus = tuple(
        GpuRecord(
            **{k: v for k, v in g.items() if k != "processes"},
            processes=tuple(ProcessRecord(int(p["pid"]), p["used_mib"]) for p in g["processes"]),
        )
        for g in data["gpus"]
    )
    return NvmlSnapshot(
        available=bool(data["available"]),
        reason=str(data["reason"]),
        driver_version=data["driver_version"],
        cuda_driver_version=data["cuda_driver_version"],
        gpus=gpus,
    )
