"""The node's only door to NVML: typed, frozen records instead of driver exceptions.

Everything here runs in the agent process, which must never initialise CUDA, so it
uses NVML (through nvidia-ml-py's ``pynvml``) and nothing from torch. ``pynvml`` is
imported lazily: the aggregator image installs this package without it, and
``fedgpu devices`` must still answer there ("NVML unavailable") instead of crashing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any, TypeVar

MIB = 1024 * 1024
_T = TypeVar("_T")


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


def _import_pynvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


_NO_PYNVML = (
    "nvidia-ml-py is not installed: install the node extra (pip install 'fedgpu[node]') "
    "or use the node image"
)


def _code_name(pynvml: ModuleType, err: BaseException) -> str:
    value = getattr(err, "value", None)
    for key, const in vars(pynvml).items():
        if key.startswith("NVML_ERROR_") and const == value:
            return key
    return f"NVML error {value}"


def _init_failure(pynvml: ModuleType, err: BaseException) -> str:
    """A reason for a failed nvmlInit that names the likely fix."""
    code = getattr(err, "value", None)
    if code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return (
            "libnvidia-ml.so.1 not found: no NVIDIA driver on this host, or the container "
            "was started without the NVIDIA Container Toolkit "
            "(--gpus / deploy.resources.reservations.devices)"
        )
    if code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return (
            "NVIDIA driver is not loaded (NVML_ERROR_DRIVER_NOT_LOADED): load the kernel "
            "module on the host (nvidia-smi must work there) and start the container with "
            "the NVIDIA Container Toolkit"
        )
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return (
            "no permission to open the NVIDIA devices (NVML_ERROR_NO_PERMISSION): run as a "
            "user allowed to open /dev/nvidia* (e.g. the 'video' group) or give the container "
            "the devices through the NVIDIA Container Toolkit"
        )
    if code == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return (
            "NVML library and kernel driver versions differ "
            "(NVML_ERROR_LIB_RM_VERSION_MISMATCH): the driver was upgraded without a reboot, "
            "or the image ships its own libnvidia-ml; reboot the host or let the toolkit "
            "inject the host's library"
        )
    return f"NVML initialisation failed: {err} ({_code_name(pynvml, err)})"


_LOST_HINT = "; the GPU fell off the bus (see dmesg for Xid 79): reset it (nvidia-smi -r) or reboot"


class _DeviceFailed(Exception):
    """A device answered with a hard error: report it unhealthy, keep the others."""


def _soft_errors(pynvml: ModuleType) -> tuple[int, ...]:
    # These say "this field cannot be read here", not "this GPU is broken": e.g. memory
    # on unified-memory boards, process lists without host PID access, old drivers.
    return (
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    )


def _field(pynvml: ModuleType, label: str, notes: list[str], read: Callable[[], _T]) -> _T | None:
    try:
        return read()
    except pynvml.NVMLError as err:
        if getattr(err, "value", None) in _soft_errors(pynvml):
            notes.append(f"{label}: {err}")
            return None
        raise _DeviceFailed(f"{label}: {err} ({_code_name(pynvml, err)})") from err


def _memory(pynvml: ModuleType, handle: Any) -> Any:
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


def _read_gpu(pynvml: ModuleType, index: int) -> GpuRecord:
    notes: list[str] = []
    uuid, name = "", ""
    try:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as err:
            raise _DeviceFailed(f"handle: {err} ({_code_name(pynvml, err)})") from err
        uuid = _field(pynvml, "uuid", notes, lambda: pynvml.nvmlDeviceGetUUID(handle)) or ""
        name = _field(pynvml, "name", notes, lambda: pynvml.nvmlDeviceGetName(handle)) or ""
        mem = _field(pynvml, "memory", notes, lambda: _memory(pynvml, handle))
        util = _field(
            pynvml, "utilization", notes, lambda: pynvml.nvmlDeviceGetUtilizationRates(handle)
        )
        cc = _field(
            pynvml,
            "compute capability",
            notes,
            lambda: pynvml.nvmlDeviceGetCudaComputeCapability(handle),
        )
        procs = _field(pynvml, "processes", notes, lambda: _processes(pynvml, handle))
    except _DeviceFailed as failed:
        return GpuRecord(
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
            reason=f"unhealthy: {failed}" + (_LOST_HINT if "GPU_IS_LOST" in str(failed) else ""),
        )
    return GpuRecord(
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
    )


def _cuda_version(raw: int) -> str:
    # NVML encodes CUDA 12.4 as 12040 (1000 * major + 10 * minor).
    return f"{raw // 1000}.{(raw % 1000) // 10}"


def _unavailable(reason: str) -> NvmlSnapshot:
    return NvmlSnapshot(False, reason, None, None, ())


def snapshot(env: Mapping[str, str] | None = None) -> NvmlSnapshot:
    """Reads the GPUs this node may use; never raises.

    ``env`` supplies ``CUDA_VISIBLE_DEVICES`` (default: this process's environment);
    pass ``{}`` for every GPU on the host.
    """
    pynvml = _import_pynvml()
    if pynvml is None:
        return _unavailable(_NO_PYNVML)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return _unavailable(_init_failure(pynvml, err))
    except OSError as err:
        return _unavailable(f"NVML could not be loaded: {err}")
    try:
        return _read_host(pynvml, os.environ if env is None else env)
    except Exception as err:  # a driver surprise must not kill the agent
        return _unavailable(f"NVML query failed: {err!r}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _read_host(pynvml: ModuleType, env: Mapping[str, str]) -> NvmlSnapshot:
    notes: list[str] = []
    driver = _field(pynvml, "driver version", notes, pynvml.nvmlSystemGetDriverVersion)
    cuda_raw = _field(pynvml, "CUDA driver version", notes, pynvml.nvmlSystemGetCudaDriverVersion)
    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as err:
        return _unavailable(f"NVML cannot count GPUs: {err} ({_code_name(pynvml, err)})")
    gpus = tuple(_read_gpu(pynvml, i) for i in range(count))
    visible_value = env.get("CUDA_VISIBLE_DEVICES")
    kept, visible_notes = _resolve_visible(gpus, visible_value, env.get("CUDA_DEVICE_ORDER"))
    reason = f"NVML sees {count} GPU{'s' if count != 1 else ''}"
    if visible_value is not None:
        reason += f"; CUDA_VISIBLE_DEVICES={visible_value!r} leaves {len(kept)}"
    unhealthy = sum(not g.healthy for g in kept)
    if unhealthy:
        reason += f"; {unhealthy} unhealthy"
    reason = "; ".join([reason, *visible_notes, *notes])
    return NvmlSnapshot(
        available=True,
        reason=reason,
        driver_version=driver,
        cuda_driver_version=None if cuda_raw is None else _cuda_version(int(cuda_raw)),
        gpus=kept,
    )


def _match_entry(gpus: Iterable[GpuRecord], entry: str) -> GpuRecord | None | str:
    """The GPU an entry names, None when it names none, or a note why it is not usable."""
    if entry.isdigit():
        return next((g for g in gpus if g.index == int(entry)), None)
    if entry.upper().startswith("MIG-"):
        return f"MIG device {entry} ignored: fedgpu selects whole GPUs only"
    wanted = entry.lower()
    if not wanted.startswith("gpu-"):
        wanted = "gpu-" + wanted
    hits = [g for g in gpus if g.uuid and g.uuid.lower().startswith(wanted)]
    if len(hits) > 1:
        return f"{entry} is an ambiguous UUID prefix ({len(hits)} GPUs match)"
    return hits[0] if hits else None


def _resolve_visible(
    gpus: tuple[GpuRecord, ...], env_value: str | None, device_order: str | None = None
) -> tuple[tuple[GpuRecord, ...], tuple[str, ...]]:
    if env_value is None:
        return gpus, ()
    kept: list[GpuRecord] = []
    notes: list[str] = []
    for raw in env_value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        match = _match_entry(gpus, entry)
        if isinstance(match, str):
            notes.append(match)
            continue
        if match is None:
            # CUDA stops at the first entry it cannot resolve and ignores the rest;
            # doing the same keeps our view equal to what a CUDA process would see.
            notes.append(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} matches no GPU; later entries ignored"
            )
            break
        if match not in kept:
            kept.append(match)
    if any(e.strip().isdigit() for e in env_value.split(",")):
        if device_order != "PCI_BUS_ID" and len({g.name for g in gpus}) > 1:
            notes.append(
                "CUDA_VISIBLE_DEVICES uses indices, read as NVML indices; CUDA numbers mixed "
                "GPU models fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID: prefer UUIDs"
            )
    return tuple(kept), tuple(notes)


def visible_filter(gpus: Iterable[GpuRecord], env_value: str | None) -> tuple[GpuRecord, ...]:
    """The GPUs that ``CUDA_VISIBLE_DEVICES=env_value`` lets this node use (None: all).

    Entries may be NVML indices, full UUIDs or UUID prefixes; MIG entries are skipped.
    """
    return _resolve_visible(tuple(gpus), env_value)[0]


def visible_notes(
    gpus: Iterable[GpuRecord], env_value: str | None, device_order: str | None = None
) -> tuple[str, ...]:
    """Why entries of ``CUDA_VISIBLE_DEVICES`` were ignored or may mislead; empty if none."""
    return _resolve_visible(tuple(gpus), env_value, device_order)[1]


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


class MemorySampler:
    """Polls one GPU's used memory while a training subprocess runs.

    NVML is initialised once for the sampler's lifetime and handles are cached, so a
    sample is one driver call. Nothing raises: a lost GPU or missing NVML reads as None.
    """

    def __init__(self) -> None:
        self._pynvml: ModuleType | None = None
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.reason = "not started"

    def __enter__(self) -> MemorySampler:
        pynvml = _import_pynvml()
        if pynvml is None:
            self.reason = _NO_PYNVML
            return self
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            self.reason = _init_failure(pynvml, err)
            return self
        except OSError as err:
            self.reason = f"NVML could not be loaded: {err}"
            return self
        self._pynvml = pynvml
        self.reason = "ok"
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        pynvml, self._pynvml = self._pynvml, None
        self._handles.clear()
        if pynvml is not None:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass

    @property
    def active(self) -> bool:
        return self._pynvml is not None

    def used_mib(self, uuid: str) -> int | None:
        """Used memory of the GPU with this UUID, or None when it cannot be read."""
        pynvml = self._pynvml
        if pynvml is None:
            return None
        # The agent may sample from a watcher thread while the main thread also samples.
        with self._lock:
            try:
                handle = self._handles.get(uuid)
                if handle is None:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                    self._handles[uuid] = handle
                mem = _memory(pynvml, handle)
            except pynvml.NVMLError as err:
                self._handles.pop(uuid, None)
                self.reason = f"{uuid}: {err} ({_code_name(pynvml, err)})"
                return None
            except Exception as err:  # sampling must never break a round
                self.reason = f"{uuid}: {err!r}"
                return None
        return int(mem.used) // MIB

    def watch_peak(self, uuid: str, interval_s: float = 0.1) -> PeakWatch:
        """A context manager that samples in a thread and keeps the peak."""
        return PeakWatch(self, uuid, interval_s)


class PeakWatch:
    """Background sampling of one GPU; ``peak_mib`` is None if no sample succeeded."""

    def __init__(self, sampler: MemorySampler, uuid: str, interval_s: float) -> None:
        self._sampler = sampler
        self._uuid = uuid
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_mib: int | None = None
        self.samples = 0

    def _sample(self) -> None:
        used = self._sampler.used_mib(self._uuid)
        if used is not None:
            self.samples += 1
            self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def __enter__(self) -> PeakWatch:
        self._sample()
        self._thread = threading.Thread(target=self._run, name="fedgpu-gpu-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # A short round can end between two ticks; one last sample bounds the peak.
        self._sample()
