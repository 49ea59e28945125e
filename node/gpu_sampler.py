"""GPU memory sampling while a round's training subprocess runs (before, peak, after).

The sampler holds NVML through node/nvml.py (its one owner) for its lifetime and caches
handles, so one sample is one driver call; the agent never imports torch, so this is how it
measures a round. A round on several devices (one worker each) is sampled per device, each
device by its UUID: a GPU's or a MIG device's (`nvml.handle_by_uuid` finds either).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import ModuleType, TracebackType
from typing import Any

from fedgpu.node import nvml
from fedgpu.node.gpu_records import MIB
from fedgpu.node.nvml import code_name, handle_by_uuid, memory_info

# How long a round's "after" reading waits for the driver to free an exited worker's memory.
SETTLE_S = 2.0


class MemorySampler:
    """Polls the used memory of a round's devices while its training subprocesses run.

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
        """Used memory of the GPU or MIG device with this UUID, or None when it cannot be
        read."""
        pynvml = self._pynvml
        if pynvml is None:
            return None
        # The agent may sample from a watcher thread while the main thread also samples.
        with self._lock:
            try:
                handle = self._handles.get(uuid)
                if handle is None:
                    handle = handle_by_uuid(pynvml, uuid)
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

    def used_mib_each(self, uuids: Sequence[str]) -> dict[str, int | None]:
        """`used_mib` of each device, by UUID (a round's before and after on N devices)."""
        return {uuid: self.used_mib(uuid) for uuid in uuids}

    def settled_mib_each(self, baseline: dict[str, int | None],
                         within_s: float = SETTLE_S) -> dict[str, int | None]:
        """Used memory of each device once it is back at its `baseline`, or what it is after
        `within_s`. The driver frees an exited process's context a moment after the process is
        reaped (a fork-server's worker on an H200 read 849 MiB at once, its baseline a few ms
        later), so the round's "after" waits that moment out instead of reporting a residue
        that is not there."""
        deadline = time.monotonic() + within_s
        while True:
            now = self.used_mib_each(tuple(baseline))
            settled = all(v is None or b is None or v <= b for v, b in
                          ((now[u], baseline[u]) for u in baseline))
            if settled or time.monotonic() >= deadline:
                return now
            time.sleep(0.05)

    def watch_peak(self, uuid: str, interval_s: float = 0.1) -> PeakWatch:
        """A context manager that samples in a thread and keeps the peak."""
        return PeakWatch(self, (uuid,), interval_s)

    def watch_peaks(self, uuids: Sequence[str], interval_s: float = 0.1) -> PeakWatch:
        """`watch_peak` for several devices at once: ``peaks`` holds each one's."""
        return PeakWatch(self, tuple(uuids), interval_s)


class PeakWatch:
    """Background sampling of a round's devices: ``peaks[uuid]`` is None for a device no
    sample of which succeeded; ``peak_mib`` is the first device's (the one-device round)."""

    def __init__(self, sampler: MemorySampler, uuids: tuple[str, ...], interval_s: float) -> None:
        if not uuids:
            raise ValueError("a peak watch needs at least one device UUID")
        self._sampler = sampler
        self._uuids = uuids
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peaks: dict[str, int | None] = dict.fromkeys(uuids)
        self.samples = 0

    @property
    def peak_mib(self) -> int | None:
        return self.peaks[self._uuids[0]]

    def _sample(self) -> None:
        for uuid in self._uuids:
            used = self._sampler.used_mib(uuid)
            if used is None:
                continue
            self.samples += 1
            peak = self.peaks[uuid]
            self.peaks[uuid] = used if peak is None else max(peak, used)

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
