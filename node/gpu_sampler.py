"""GPU memory sampling while a round's training subprocess runs (before, peak, after).

The sampler holds NVML through node/nvml.py (its one owner) for its lifetime and caches
handles, so one sample is one driver call; the agent never imports torch, so this is how it
measures a round.
"""

from __future__ import annotations

import threading
from types import ModuleType, TracebackType
from typing import Any

from fedgpu.node import nvml
from fedgpu.node.gpu_records import MIB
from fedgpu.node.nvml import code_name, memory_info


class MemorySampler:
    """Polls one GPU's used memory while a training subprocess runs.

    NVML is held (node/nvml.py's `acquire`) for the sampler's lifetime and handles are
    cached, so a sample is one driver call. Nothing raises: a lost GPU or missing NVML
    reads as None.
    """

    def __init__(self) -> None:
        self._pynvml: ModuleType | None = None
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.reason = "not started"

    def __enter__(self) -> MemorySampler:
        self._pynvml, self.reason = nvml.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._lock:
            held, self._pynvml = self._pynvml, None
            self._handles.clear()
        if held is not None:
            nvml.release()

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
                mem = memory_info(pynvml, handle)
            except pynvml.NVMLError as err:
                self._handles.pop(uuid, None)
                self.reason = f"{uuid}: {err} ({code_name(pynvml, err)})"
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
