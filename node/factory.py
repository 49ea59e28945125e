"""The worker factory: one process per host that forks every round's worker.

`python -m fedgpu.node.factory --socket PATH [--cpu-slots N]` (or `fedgpu node factory`).
It imports torch and the training stack once, never initialises CUDA, and forks a round's
worker on request: the child shares the imported pages copy-on-write, starts in milliseconds,
gets its own CUDA context when its round uses the GPU, and exits after the round, so the driver
takes back all of its GPU memory, as with a freshly spawned worker. The node agents of a host
share one factory (memory O(1) per host instead of one idle ~300 MB worker per node); an agent
without one starts its own (node/factory_client.py).

Fork safety: the factory forks only from a single-threaded state (OpenBLAS and torch are held
to one thread here, and before every fork it checks that it still has exactly one thread and
that CUDA is untouched, else it refuses and the agent spawns a fresh worker instead). The child
reseeds every RNG, restores default signal handlers, sets its torch threads and the round's
environment (CUDA_VISIBLE_DEVICES before anything touches CUDA), and logs where its agent logs.

Lifetimes: the factory ends with its parent (fedgpu.core.lifetime) and kills its workers when it
stops; a worker ends with the factory (PR_SET_PDEATHSIG), and the factory kills a worker as
soon as the connection of the agent that asked for it closes (the agent died), so no worker
outlives its agent. Slots (node/slots.py) bound how many workers train at once.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import random
import selectors
import signal
import socket
import stat
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedgpu.core import lifetime
from fedgpu.node import factory_wire as wire
from fedgpu.node.slots import Need, Slots, default_cpu_slots

log = logging.getLogger("fedgpu.factory")

# Read when numpy's OpenBLAS loads, so set before numpy is imported: its thread pool would
# otherwise start threads here, and a fork with other threads alive is not safe. (torch's own
# pools start threads only when used with more than one; the factory runs them on one.)
SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1"}
MAX_CONNECTIONS = 1024
MAX_ENV_ENTRIES = 4096
_PR_SET_NAME = 15
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
WORKER_NAME = b"fedgpu-round"


class Stop(BaseException):
    """A stop signal: unwinds the serving loop so the workers are killed on the way out."""


@dataclass(frozen=True)
class Spawn:
    """One validated spawn request."""

    workdir: Path
    env: dict[str, str]
    node: str
    need: Need
    torch_threads: int | None
    warm: dict[str, Any] | None


def parse_spawn(msg: dict[str, Any]) -> Spawn:
    """Check a spawn request field by field; every problem is a one-line ValueError."""
    workdir = msg.get("workdir")
    if not isinstance(workdir, str) or not os.path.isabs(workdir) or not os.path.isdir(workdir):
        raise ValueError(f"workdir must be an existing absolute directory, got {workdir!r}")
    env = msg.get("env")
    if (not isinstance(env, dict) or len(env) > MAX_ENV_ENTRIES
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError(f"env must be an object of at most {MAX_ENV_ENTRIES} strings")
    node = msg.get("node", "")
    if not isinstance(node, str) or len(node) > 200:
        raise ValueError("node must be a string of at most 200 characters")
    device = msg.get("device", "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    uuid = msg.get("gpu_uuid")
    share = msg.get("gpu_share")
    if uuid is not None and not isinstance(uuid, str):
        raise ValueError("gpu_uuid must be a string or null")
    if share is not None and (isinstance(share, bool) or not isinstance(share, int | float)
                              or not 0 < share <= 1):
        raise ValueError(f"gpu_share must be in (0, 1] or null, got {share!r}")
    threads = msg.get("torch_threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"torch_threads must be a positive integer or null, got {threads!r}")
    warm = msg.get("warm")
    if warm is not None and not isinstance(warm, dict):
        raise ValueError("warm must be an object or null")
    return Spawn(Path(workdir), dict(env), node, Need(device, uuid, share), threads, warm)


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


def check_socket_dir(path: Path) -> None:
    """The socket's directory must be ours and closed to everyone else: that, and the peer uid
    check on every connection, is what keeps other users from running code through us. A
    missing one is made so."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
        path.parent.chmod(0o700)  # whatever the umask
    st = path.parent.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise SystemExit(f"fedgpu factory: {path.parent} must belong to uid {os.getuid()} and "
                         f"be private (chmod 700); it is uid {st.st_uid}, mode "
                         f"{stat.S_IMODE(st.st_mode):o}")


def bind(path: Path) -> socket.socket:
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SystemExit(f"fedgpu factory: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # left by a factory that died: nobody listens on it
        else:
            raise SystemExit(f"fedgpu factory: another factory already serves {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:
            continue
    return names


def cuda_touched() -> str | None:
    """Why a fork from here would hand the child a broken CUDA, or None."""
    import torch

    if torch.cuda.is_initialized():
        return "torch initialised CUDA in the factory"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    if "libcuda.so" in maps:
        return "the CUDA driver library is loaded in the factory"
    return None


class Factory:
    def __init__(self, path: Path, cpu_slots: int, default_threads: int) -> None:
        self.path = path
        self.slots: Slots[Request] = Slots(cpu_slots)
        self.default_threads = default_threads
        self.sel = selectors.DefaultSelector()
        self.listener = bind(path)
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
        unsafe = self._unsafe()
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

    def _unsafe(self) -> str | None:
        names = thread_names()
        if len(names) > 1:
            return (f"the factory runs {len(names)} threads ({', '.join(names)}); forking is "
                    "safe only from a single-threaded process")
        return cuda_touched()

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
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def _warm_up(self, hint: dict[str, Any] | None) -> None:
        """Once per task: one throw-away step on the CPU, so later workers inherit warm code.

        Only installed tasks (entry points), never code that came with a job.
        """
        name = (hint or {}).get("task_name")
        if not isinstance(name, str) or name in self.warmed:
            return
        self.warmed.add(name)
        from fedgpu.node import worker
        from fedgpu.node.tasks import available_tasks

        if name not in available_tasks():
            return
        started = time.monotonic()
        try:
            worker._warm_up(hint)
        except Exception as exc:  # a round reports a real problem; this only warms up
            log.warning("warm-up for task %r failed: %s", name, exc)
            return
        gc.freeze()
        log.info("warmed up task %r in %.2fs", name, time.monotonic() - started)

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


def run_worker(spawn: Spawn, factory_pid: int, threads: int) -> int:
    """The forked child's round, as `python -m fedgpu.node.worker WORKDIR` would run it."""
    os.environ.clear()
    os.environ.update(spawn.env)
    # Dies with the factory, even a SIGKILLed one (the factory kills it when its agent dies).
    os.environ[lifetime.PARENT_ENV] = str(factory_pid)
    lifetime.bind_to_parent()
    _name_process(WORKER_NAME)
    _reseed()
    import torch

    # A fresh intra-op pool in the child; the factory itself ran on one thread.
    torch.set_num_threads(threads)
    tag = f" [{spawn.node}]" if spawn.node else ""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format=f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s")
    # Checked again in the child, where it matters: its CUDA must be its own.
    logging.getLogger("fedgpu.worker").info(
        "worker pid %d forked by the factory %d: CUDA initialised before the task: %s",
        os.getpid(), factory_pid, "yes" if torch.cuda.is_initialized() else "no")
    from fedgpu.node import worker

    return worker.run(spawn.workdir)


def _reseed() -> None:
    """Every child starts from the factory's RNG states; the round reseeds from its own seed,
    but nothing drawn before that may repeat across workers."""
    import numpy as np
    import torch

    seed = int.from_bytes(os.urandom(8), "little")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def _name_process(name: bytes) -> None:
    # `ps -o comm`, psutil's name() and top show the worker for what it is.
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _stop(signum: int, _frame: object) -> None:
    raise Stop(signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedgpu.node.factory")
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
    check_socket_dir(path)
    try:
        default_threads = _load_stack()
        Factory(path, args.cpu_slots or default_cpu_slots(), default_threads).serve()
    except Stop as stop:
        log.info("stopping on %s; workers killed", signal.Signals(stop.args[0]).name)
    return 0


def _load_stack() -> int:
    """Import torch and the training stack single-threaded; the torch threads a worker would
    have had by default."""
    for key, value in SINGLE_THREADED.items():
        os.environ.setdefault(key, value)
    started = time.monotonic()
    import torch

    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from fedgpu.node import runner, worker  # noqa: F401 - imported once here, shared by forks

    worker._warm_up(None)
    gc.collect()
    # Objects that live as long as the factory stay out of the collector's sweeps, so a child's
    # collections do not write to (and so copy) the pages it shares with the factory.
    gc.freeze()
    log.info("imported torch %s and the training stack in %.1fs", torch.__version__,
             time.monotonic() - started)
    return default_threads


if __name__ == "__main__":
    sys.exit(main())
