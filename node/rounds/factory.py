"""The worker factory: one process per host that forks every round's worker.

`python -m fedgpu.node.rounds.factory --socket PATH [--cpu-slots N]` (or `fedgpu node factory`).
It imports torch and the training stack once, never initialises CUDA, and forks a round's
worker on request: the child shares the imported pages copy-on-write, starts in milliseconds,
gets its own CUDA context when its round uses the GPU, and exits after the round, so the driver
takes back all of its GPU memory, as with a freshly spawned worker. The node agents of a host
share one factory (memory O(1) per host instead of one idle ~300 MB worker per node); an agent
without one starts its own (node/rounds/factory_client.py).

Fork safety: the factory forks only from a single-threaded state (OpenBLAS and torch are held
to one thread here, and before every fork it checks that it still has exactly one thread and
that CUDA is untouched, else it refuses and the agent spawns a fresh worker instead). The child
reseeds every RNG, restores default signal handlers, sets its torch threads and the round's
environment (CUDA_VISIBLE_DEVICES before anything touches CUDA), and logs where its agent logs.

Lifetimes: the factory ends with its parent (fedgpu.core.lifetime) and kills its workers when it
stops; a worker ends with the factory (PR_SET_PDEATHSIG), and the factory kills a worker as
soon as the connection of the agent that asked for it closes (the agent died), so no worker
outlives its agent. Slots (node/rounds/slots.py) bound how many workers train at once.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedgpu.core import lifetime
from fedgpu.node.rounds import factory_wire as wire
from fedgpu.node.rounds.fork import (
    Spawn,
    fork_hazard,
    load_stack,
    parse_spawn,
    run_worker,
    warm_up,
)
from fedgpu.node.rounds.slots import Slots, default_cpu_slots

log = logging.getLogger("fedgpu.factory")

MAX_CONNECTIONS = 1024
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


class Stop(BaseException):
    """A stop signal: unwinds the serving loop so the workers are killed on the way out."""


@dataclass(eq=False)
class Request:
    """One agent connection: a worker asked for, waiting for a slot, running, or done."""

    conn: socket.socket
    peer_pid: int
    reader: wire.Reader = field(default_factory=wire.Reader)
    spawn: Spawn | None = None
    fds: list[int] = field(default_factory=list)
    received: float = 0.0
    pid: int | None = None
    pidfd: int | None = None


class Factory:
    def __init__(self, path: Path, cpu_slots: int, default_threads: int) -> None:
        self.path = path
        self.slots: Slots[Request] = Slots(cpu_slots)
        self.default_threads = default_threads
        self.sel = selectors.DefaultSelector()
        self.listener = wire.bind(path)
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.requests: set[Request] = set()
        self.warmed: set[str] = set()
        self.forked = 0
        self.pidfds = hasattr(os, "pidfd_open")

    # ---- the loop ------------------------------------------------------------------------

    def serve(self) -> None:
        log.info("worker factory ready on %s (pid %d, %d CPU slot(s); unless its node says "
                 "otherwise a CPU worker trains on %d torch thread(s), a GPU worker on %d)",
                 self.path, os.getpid(), self.slots.cpu_slots,
                 max(1, self.default_threads // self.slots.cpu_slots), self.default_threads)
        try:
            while True:
                # Without pidfds a child's exit is found by polling waitpid.
                for key, _ in self.sel.select(timeout=None if self.pidfds else 0.05):
                    if key.data == "accept":
                        self._accept()
                    elif isinstance(key.data, tuple):
                        self._exited(key.data[1])
                    else:
                        self._readable(key.data)
                self._poll_children()
        finally:
            self.close()

    def close(self) -> None:
        for req in list(self.requests):
            if req.pid is not None:
                self._kill(req)
                try:
                    os.waitpid(req.pid, 0)
                except ChildProcessError:
                    pass
                req.pid = None
            self._drop(req)
        self.sel.close()
        self.listener.close()
        try:
            self.path.unlink()
        except OSError:
            pass

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != os.getuid() or len(self.requests) >= MAX_CONNECTIONS:
            why = (f"uid {uid} is not the factory's" if uid != os.getuid()
                   else f"{MAX_CONNECTIONS} connections already open")
            log.warning("refused a connection from pid %d: %s", pid, why)
            conn.close()
            return
        conn.setblocking(False)
        req = Request(conn, pid)
        self.requests.add(req)
        self.sel.register(conn, selectors.EVENT_READ, req)

    def _readable(self, req: Request) -> None:
        try:
            open_ = req.reader.receive(req.conn)
            req.fds.extend(req.reader.take_fds())
            msgs = req.reader.messages()
        except (OSError, wire.WireError) as exc:
            log.warning("dropping the connection of pid %d: %s", req.peer_pid, exc)
            open_, msgs = False, []
        for msg in msgs:
            if msg.get("op") == wire.Op.SPAWN and req.spawn is None:
                self._spawn(req, msg)
            elif msg.get("op") == wire.Op.KILL:
                self._kill(req)
                if req.pid is None:
                    open_ = False  # still waiting for a slot: nothing to kill, just forget it
            else:
                self._reply(req, {"event": wire.Event.REFUSED, "error": f"unexpected {msg!r}"})
        if not open_:
            # The agent is gone (or gave up): its worker must not train on for nobody.
            if req.pid is not None:
                self._kill(req)
                self._unregister(req.conn)
                log.info("agent pid %d went away: killed its worker %d", req.peer_pid, req.pid)
            else:
                self._drop(req)

    def _spawn(self, req: Request, msg: dict[str, Any]) -> None:
        try:
            req.spawn = parse_spawn(msg)
        except ValueError as exc:
            self._reply(req, {"event": wire.Event.REFUSED, "error": str(exc)})
            return
        req.received = time.monotonic()
        self.slots.submit(req, req.spawn.need)
        self._schedule()
        if req.pid is None and req in self.requests:
            log.info("%s waits for a %s slot (%d running, %d waiting)", req.spawn.node or "a node",
                     req.spawn.need.resource(), self.slots.running(), self.slots.queued())

    def _schedule(self) -> None:
        for req in self.slots.ready():
            self._fork(req)

    # ---- forking -------------------------------------------------------------------------

    def _fork(self, req: Request) -> None:
        assert req.spawn is not None
        # Before the first worker of a task: it, and every later one, inherits the warm state.
        self._warm_up(req.spawn.warm)
        unsafe = fork_hazard()
        if unsafe:
            log.error("not forking: %s; the agent spawns a fresh worker instead", unsafe)
            self._reply(req, {"event": wire.Event.REFUSED, "error": unsafe})
            self.slots.release(req)
            return
        queued = time.monotonic() - req.received
        sys.stdout.flush()
        sys.stderr.flush()
        # No stop signal may run the factory's handler in the child (it would unwind into the
        # factory's cleanup and kill the other workers): held until the child has reset them.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            pid = os.fork()
            if pid == 0:
                self._become_worker(req)  # never returns
        except OSError as exc:
            # Out of processes or memory: this round spawns its own worker (or fails there).
            log.error("cannot fork a worker for %s: %s", req.spawn.node or "a node", exc)
            self._reply(req, {"event": wire.Event.REFUSED, "error": f"cannot fork: {exc}"})
            self.slots.release(req)
            return
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        self.forked += 1
        req.pid = pid
        for fd in req.fds:  # the child has its own copies
            os.close(fd)
        req.fds = []
        if self.pidfds:
            try:
                req.pidfd = os.pidfd_open(pid)
            except OSError:  # a kernel before 5.3: poll waitpid instead, from now on
                self.pidfds = False
            else:
                self.sel.register(req.pidfd, selectors.EVENT_READ, ("exit", req))
        self._reply(req, {"event": wire.Event.STARTED, "pid": pid, "queued_s": round(queued, 4)})
        log.info("worker %d for %s started%s; %d running, %d waiting", pid,
                 req.spawn.node or "a node", f" after {queued:.2f}s in the queue" if queued > 0.01
                 else "", self.slots.running(), self.slots.queued())

    def _threads(self, spawn: Spawn) -> int:
        """Torch threads of a worker whose node did not say: a CPU round shares the cores with
        the other CPU slots' rounds; a GPU round gets what a lone worker would."""
        if spawn.torch_threads:
            return spawn.torch_threads
        asked = spawn.env.get("OMP_NUM_THREADS", "")
        if asked.isdigit() and int(asked) > 0:
            return int(asked)  # what torch would have read at the start of a spawned worker
        if spawn.need.resource() == "cpu":
            return max(1, self.default_threads // self.slots.cpu_slots)
        return self.default_threads

    def _become_worker(self, req: Request) -> None:
        """In the child: become the round's worker, run the round, exit. Never returns."""
        code = 1
        try:
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            factory = os.getppid()
            own = set(req.fds)
            for other in self.requests:
                if other is not req:
                    other.conn.close()
                    if other.pidfd is not None:
                        os.close(other.pidfd)
                    for fd in other.fds:
                        os.close(fd)
            self.listener.close()
            self.sel.close()
            req.conn.close()
            if len(req.fds) >= 2:
                os.dup2(req.fds[0], 1)
                os.dup2(req.fds[1], 2)
            for fd in own:
                if fd > 2:
                    os.close(fd)
            code = run_worker(req.spawn, factory, self._threads(req.spawn))  # type: ignore[arg-type]
        except BaseException:  # noqa: B036 - whatever happens, the child must not return
            import traceback

            traceback.print_exc()
        finally:
            lifetime.exit_now(code)

    def _warm_up(self, hint: dict[str, Any] | None) -> None:
        if warm_up(hint, self.warmed):
            gc.freeze()

    # ---- endings -------------------------------------------------------------------------

    def _exited(self, req: Request) -> None:
        assert req.pid is not None
        try:
            _, status = os.waitpid(req.pid, 0)
        except ChildProcessError:
            status = 0
        self._finish(req, os.waitstatus_to_exitcode(status))

    def _poll_children(self) -> None:
        for req in [r for r in self.requests if r.pid is not None and r.pidfd is None]:
            assert req.pid is not None
            done, status = os.waitpid(req.pid, os.WNOHANG)
            if done:
                self._finish(req, os.waitstatus_to_exitcode(status))

    def _finish(self, req: Request, code: int) -> None:
        log.info("worker %d for %s exited with %d", req.pid,
                 req.spawn.node if req.spawn else "?", code)
        self._reply(req, {"event": wire.Event.EXITED, "code": code})
        req.pid = None
        self._drop(req)
        self._schedule()

    def _kill(self, req: Request) -> None:
        if req.pid is None:
            return
        try:
            if req.pidfd is not None:
                signal.pidfd_send_signal(req.pidfd, signal.SIGKILL)
            else:
                os.kill(req.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _drop(self, req: Request) -> None:
        """Forget a connection whose worker has ended or never started."""
        if req.pid is not None:
            return  # still running: dropped when its exit is collected
        self.slots.release(req)
        self.requests.discard(req)
        for fd in req.fds:
            os.close(fd)
        req.fds = []
        for obj in (req.conn, req.pidfd):
            if obj is not None:
                self._unregister(obj)
        if req.pidfd is not None:
            os.close(req.pidfd)
            req.pidfd = None
        req.conn.close()

    def _unregister(self, obj: socket.socket | int) -> None:
        try:
            self.sel.unregister(obj)
        except (KeyError, ValueError):
            pass

    def _reply(self, req: Request, msg: dict[str, Any]) -> None:
        try:
            req.conn.setblocking(True)
            req.conn.settimeout(5)
            wire.send(req.conn, msg)
        except OSError:
            pass  # the agent went away; its EOF is handled where it is read
        finally:
            try:
                req.conn.setblocking(False)
            except OSError:
                pass


def _stop(signum: int, _frame: object) -> None:
    raise Stop(signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedgpu.node.rounds.factory")
    ap.add_argument("--socket", required=True, type=Path)
    ap.add_argument("--cpu-slots", type=int, default=0,
                    help="CPU rounds training at once (0: one per usable core)")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    lifetime.bind_to_parent()
    lifetime.handle_signals(_stop)
    if args.cpu_slots < 0:
        raise SystemExit("fedgpu factory: --cpu-slots must be >= 0")
    path = args.socket.absolute()
    wire.check_socket_dir(path)
    try:
        default_threads = load_stack()
        Factory(path, args.cpu_slots or default_cpu_slots(), default_threads).serve()
    except Stop as stop:
        log.info("stopping on %s; workers killed", signal.Signals(stop.args[0]).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
