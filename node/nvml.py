"""The node's only door to NVML: the driver calls, turned into typed, frozen records
(node/gpu_records.py) instead of driver exceptions, and the one owner of NVML's lifecycle in
the process (as nvitop's libnvml): `acquire`/`release` (or `session()`) initialise NVML for
the first user and shut it down after the last. The round's memory sampler
(node/gpu_sampler.py) holds it for the agent's life, so its samples cost one driver call
each, and snapshots taken meanwhile reuse it instead of initialising NVML again.

Everything here runs in the agent process, which must never initialise CUDA, so it
uses NVML (through nvidia-ml-py's ``pynvml``) and nothing from torch. ``pynvml`` is
imported lazily: the aggregator image installs this package without it, and
``fedgpu devices`` must still answer there ("NVML unavailable") instead of crashing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType

# The records, and the CUDA_VISIBLE_DEVICES helpers, are what a snapshot is made of; they are
# re-exported so callers keep one import for "what NVML says".
from fedgpu.node.gpu_records import (
    MIB,
    GpuRecord,
    MigPlacement,
    NvmlSnapshot,
    ProcessRecord,
    from_dict,
    to_dict,
    training_devices,
)
from fedgpu.node.gpu_visible import resolve_visible, visible_filter, visible_notes
from fedgpu.node.nvml_device import code_name, field, memory_info, read_device
from fedgpu.node.nvml_mig import handle_by_uuid, with_mig

__all__ = [
    "MIB", "GpuRecord", "MigPlacement", "NvmlSnapshot", "ProcessRecord", "from_dict", "to_dict",
    "training_devices", "visible_filter", "visible_notes", "snapshot", "import_pynvml",
    "init_failure", "memory_info", "code_name", "handle_by_uuid", "NO_PYNVML", "acquire",
    "release", "session",
]


def import_pynvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


NO_PYNVML = (
    "nvidia-ml-py is not installed: install the node extra (pip install 'fedgpu[node]') "
    "or use the node image"
)


def init_failure(pynvml: ModuleType, err: BaseException) -> str:
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
    return f"NVML initialisation failed: {err} ({code_name(pynvml, err)})"


class _Owner:
    """Who initialised NVML in this process, and how many users hold it now."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pynvml: ModuleType | None = None
        self.users = 0

    def acquire(self) -> tuple[ModuleType | None, str]:
        with self.lock:
            if self.pynvml is not None:
                self.users += 1
                return self.pynvml, "ok"
            pynvml = import_pynvml()
            if pynvml is None:
                return None, NO_PYNVML
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as err:
                return None, init_failure(pynvml, err)
            except OSError as err:
                return None, f"NVML could not be loaded: {err}"
            self.pynvml, self.users = pynvml, 1
            return pynvml, "ok"

    def release(self) -> None:
        with self.lock:
            if self.pynvml is None:
                return
            self.users -= 1
            if self.users > 0:
                return
            pynvml, self.pynvml = self.pynvml, None
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass


_OWNER = _Owner()


def _forked() -> None:
    # A forked child (a round's worker) shares none of its parent's NVML session: it starts
    # with no users, and a fresh lock (the parent's may have been held by another thread).
    global _OWNER
    _OWNER = _Owner()


os.register_at_fork(after_in_child=_forked)


def acquire() -> tuple[ModuleType | None, str]:
    """NVML, initialised (by this call if no one holds it), and "ok"; or None and the reason
    it cannot be used. Each success is paired with one `release()`. Never raises."""
    return _OWNER.acquire()


def release() -> None:
    """One user is done; the last one shuts NVML down."""
    _OWNER.release()


@contextmanager
def session() -> Iterator[tuple[ModuleType | None, str]]:
    """`acquire()` for the duration of a `with` block."""
    pynvml, reason = acquire()
    try:
        yield pynvml, reason
    finally:
        if pynvml is not None:
            release()


def _read_gpu(pynvml: ModuleType, index: int) -> GpuRecord:
    record, handle = read_device(pynvml, lambda: pynvml.nvmlDeviceGetHandleByIndex(index), index)
    # An unhealthy GPU's MIG devices are not asked for: it answers nothing else either.
    return record if handle is None else with_mig(pynvml, handle, record)


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
    with session() as (pynvml, reason):
        if pynvml is None:
            return _unavailable(reason)
        try:
            return _read_host(pynvml, os.environ if env is None else env)
        except Exception as err:  # a driver surprise must not kill the agent
            return _unavailable(f"NVML query failed: {err!r}")


def _read_host(pynvml: ModuleType, env: Mapping[str, str]) -> NvmlSnapshot:
    notes: list[str] = []
    driver = field(pynvml, "driver version", notes, pynvml.nvmlSystemGetDriverVersion)
    cuda_raw = field(pynvml, "CUDA driver version", notes, pynvml.nvmlSystemGetCudaDriverVersion)
    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as err:
        return _unavailable(f"NVML cannot count GPUs: {err} ({code_name(pynvml, err)})")
    gpus = tuple(_read_gpu(pynvml, i) for i in range(count))
    visible_value = env.get("CUDA_VISIBLE_DEVICES")
    kept, visible_notes = resolve_visible(gpus, visible_value, env.get("CUDA_DEVICE_ORDER"))
    reason = f"NVML sees {count} GPU{'s' if count != 1 else ''}"
    if visible_value is not None:
        reason += f"; CUDA_VISIBLE_DEVICES={visible_value!r} leaves {len(kept)}"
    in_mig = [g for g in kept if g.mig_mode]
    if in_mig:
        n = sum(len(g.mig_devices) for g in in_mig)
        reason += (f"; {len(in_mig)} in MIG mode with {n} MIG device{'s' if n != 1 else ''}")
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


