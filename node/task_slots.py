"""A site's slots (`fedgpu node start --slots N`): up to N round tasks at once, of different jobs.

Each slot is a loop of its own (poll the aggregator, run the task it gets in a round worker
process, report), and the agent's heartbeats go on beside them in their thread. The first slot
runs on the calling thread (with one slot nothing changes: the agent's loop is that thread, as
it always was, and a stop signal unwinds it there); the others run on threads of their own.
What the slots share is guarded where it lives: the tasks in hand (node/liveness.py, whose ids
every poll names so that the aggregator does not hand one slot another's task), GPU memory
admitted to each task (node/gpu_admission.py), and registering again (one slot does it).

A slot's loop ending ends the agent (the node was retired, or an error no retry fixes): the
other slots are told to stop, their round workers killed, and the first error is raised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("fedgpu.node")

# How long a slot thread may take to finish after the agent stops (its poll ends, its worker
# is killed): a thread still running then is left to the process exit (it is a daemon).
JOIN_TIMEOUT_S = 30.0


class TaskSlots:
    """Runs `serve(slot)` once per slot until each returns; the agent's loop with N slots."""

    def __init__(self, count: int, serve: Callable[[int], int], stop: threading.Event,
                 end: Callable[[], None], name: str = "node") -> None:
        """`end`: stops the whole agent from any thread (its polls end, its workers die)."""
        self.count = max(1, count)
        self._serve = serve
        self._stop = stop
        self._end = end
        self._name = name
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def run(self) -> int:
        if self.count == 1:
            return self._serve(0)
        threads = [threading.Thread(target=self._slot, args=(i,), daemon=True,
                                    name=f"{self._name}:slot-{i}")
                   for i in range(1, self.count)]
        for t in threads:
            t.start()
        log.info("serving up to %d round tasks at once (--slots %d)", self.count, self.count)
        try:
            code = self._serve(0)
        finally:
            # The first slot ended (retired, stopped, an error): so do the others.
            self._end()
        for t in threads:
            t.join(JOIN_TIMEOUT_S)
        with self._lock:
            if self._error is not None:
                raise self._error
        return code

    def _slot(self, index: int) -> None:
        try:
            self._serve(index)
        except BaseException as exc:  # noqa: BLE001 - handed to the first slot's thread
            with self._lock:
                if self._error is None and not self._stop.is_set():
                    self._error = exc
            if not self._stop.is_set():
                log.error("slot %d stopped on an error: %s", index, exc)
        finally:
            # One slot ending ends the agent (the first slot's loop sees the stop).
            self._end()
