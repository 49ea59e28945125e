"""Every process fedgpu starts ends with its parent, and Ctrl-C works however we were started.

A parent that starts a fedgpu child (`fedgpu run` its aggregator and nodes, an agent its round
workers) puts its pid in the child's environment with `child_env`; the child calls
`bind_to_parent` first thing. On Linux that asks the kernel for a signal when the parent dies
(prctl PR_SET_PDEATHSIG), even by SIGKILL, where no handler of the parent could run. Elsewhere a
daemon thread watches the parent pid. Either way, a parent that died before the child got that
far is noticed by comparing the pid the parent wrote with the child's actual parent.

Python installs its Ctrl-C handler only when SIGINT is not ignored at start, and a shell script
starts background jobs (`cmd &`) with SIGINT ignored: `handle_signals` installs the handlers
explicitly so those processes still stop on Ctrl-C.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import NoReturn

PARENT_ENV = "FEDGPU_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCH_S = 0.5
# A process told to stop is gone within this long, cleanly or not (exit_within).
STOP_LIMIT_S = 8.0

Handler = Callable[[int, FrameType | None], object]


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: ours) plus this process's pid, for a child that must die with us."""
    out = dict(os.environ if env is None else env)
    out[PARENT_ENV] = str(os.getpid())
    return out


def bind_to_parent(sig: int = signal.SIGTERM) -> bool:
    """Get `sig` when the parent that named itself in FEDGPU_PARENT_PID dies.

    Returns False when no parent asked for it (started by a person, a container runtime). The
    variable is removed from our environment so our own children never inherit a stale pid.
    """
    raw = os.environ.pop(PARENT_ENV, None)
    if not raw or not raw.isdigit():
        return False
    parent = int(raw)
    if os.getppid() != parent:
        if not _alive(parent):
            # It died before we could ask to be told: nobody would ever signal us now.
            os.kill(os.getpid(), sig)
            return True
        # Started through something in between (a wrapper that forked): watch the pid itself.
        _start_watch(lambda: not _alive(parent), sig)
        return True
    if not _pdeathsig(sig):
        _start_watch(lambda: os.getppid() != parent, sig)
    # The parent may have died between our check and the prctl: then no signal is coming.
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie has exited; only its own parent has not collected it yet.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _pdeathsig(sig: int) -> bool:
    # Note the kernel's rule: the signal comes when the parent *thread* that started us ends.
    # fedgpu starts its children from the main thread, which lives as long as the process.
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _start_watch(gone: Callable[[], bool], sig: int) -> None:
    def watch() -> None:
        while not stop.wait(_WATCH_S):
            if gone():
                os.kill(os.getpid(), sig)
                return

    stop = threading.Event()
    threading.Thread(target=watch, name="fedgpu-parent-watch", daemon=True).start()


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def exit_now(code: int) -> NoReturn:
    """End the process with `code` now, without the interpreter's teardown, its output flushed.

    For a process whose every result is already written (a round's worker): that teardown
    can abort a process whose work succeeded. A collective backend's C++ threads may still
    hold tensors when the interpreter is torn down and reach for its lock (gloo: SIGABRT,
    "terminate called without an active exception", pytorch/pytorch#179291; seen in CI on one
    rank of a data-parallel round after its result was written). Also how a forked child
    ends, which must never return into its parent's code."""
    try:
        logging.shutdown()
        _flush_std()
    finally:  # whatever the flush meets (a signal's exception too), the process ends here
        os._exit(code)


def exit_within(seconds: float, code: int) -> None:
    """Stopping: end the process with `code` after `seconds` whatever still holds it.

    A clean stop can hang past any grace: a thread blocked in a transfer that retries until its
    resume window closes, or the interpreter's exit hook that joins such threads. The parent
    that is gone (or the operator who asked) expects us gone in seconds, not when they return.
    """
    def cut() -> None:
        # Not exit_now: a thread stuck mid-write may hold a logging handler's lock.
        _flush_std()
        os._exit(code)

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()


def handle_signals(handler: Handler,
                   signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
                   ) -> None:
    """Install `handler` for each signal, whatever its disposition was when we started.

    Except SIGHUP when it is ignored: that is `nohup`, whose whole point is surviving it.
    """
    for sig in signals:
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, handler)


def restore_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt again, even when SIGINT was inherited as ignored."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def exit_code(sig: int) -> int:
    """The shell's convention for a process ended by `sig`."""
    return 128 + int(sig)
