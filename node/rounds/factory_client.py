"""The agent's side of the worker factory (node/rounds/factory.py): ask for a round's worker, watch
it.

Torch-free. A `FactoryClient` talks to a factory's socket: a host's shared one (`fedgpu node
start --worker-factory PATH`), or one the agent starts for itself (`LocalFactory`, the default:
one per agent, e.g. one per container). A `FactoryWorker` waits and kills like
`subprocess.Popen`, so the round code treats both kinds of worker the same.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedgpu.core.lifetime import child_env
from fedgpu.node.rounds import factory_wire as wire
from fedgpu.node.rounds.slots import Need
from fedgpu.node.rounds.workfiles import ROUND_ENV_KEYS

log = logging.getLogger("fedgpu.node.rounds.factory")
SOCKET_NAME = "factory.sock"
# A factory imports torch before it listens: seconds on a CPU build, more with CUDA's.
READY_TIMEOUT_S = 180.0
# How long a round waits for a host's shared factory that is not (or no longer) listening —
# starting, or being restarted — before it spawns its own worker. Once it waited in vain,
# later rounds try the factory once and spawn at once until it answers again.
SHARED_WAIT_S = 30.0


class FactoryUnavailable(Exception):
    """No worker from the factory this time. `fallback`: the round may spawn its own worker
    instead (the factory is down or refused); else the agent is stopping."""

    def __init__(self, message: str, fallback: bool = True) -> None:
        super().__init__(message)
        self.fallback = fallback


class FactoryWorker:
    """A round worker the factory forked: `wait`, `poll` and `kill` as with subprocess.Popen."""

    def __init__(self, sock: socket.socket, reader: wire.Reader, pid: int, queued_s: float,
                 on_close: Any = None) -> None:
        self._sock = sock
        self._reader = reader
        self.pid = pid
        self.queued_s = queued_s
        self.returncode: int | None = None
        # Set when the factory went away mid-round (the worker ended with it).
        self.lost: str | None = None
        self._on_close = on_close

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        self._sock.settimeout(timeout)
        try:
            while True:
                msg = wire.recv_one(self._sock, self._reader)
                if msg is None:
                    self.lost = "the worker factory ended during the round (its worker with it)"
                    self.returncode = -9
                    return self.returncode
                if msg.get("event") == wire.Event.EXITED and isinstance(msg.get("code"), int):
                    self.returncode = int(msg["code"])
                    return self.returncode
        except TimeoutError:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0) from None
        except (OSError, wire.WireError) as exc:
            self.lost = f"lost the worker factory during the round: {exc}"
            self.returncode = -9
            return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Ask the factory to kill the worker (SIGKILL); `wait` then returns its status."""
        if self.returncode is not None:
            return
        try:
            # Possibly from another thread while `wait` reads: a few bytes, no timeout change.
            wire.send(self._sock, {"op": wire.Op.KILL})
        except OSError:
            pass

    def close(self) -> None:
        """Done with it; closing before it exited makes the factory kill it."""
        if self._on_close is not None:
            self._on_close(self)
        self._sock.close()


# sun_path holds 108 bytes with its NUL: a longer socket path cannot be bound at all.
MAX_SOCKET_PATH = 107


def socket_dir() -> Path:
    """A new private directory for the factory's socket: under TMPDIR, or under /tmp where
    TMPDIR is too deep for a unix socket path (a mapped volume, a test's temporary folder)."""
    made = Path(tempfile.mkdtemp(prefix="fedgpu-factory-"))
    if len(os.fsencode(made / SOCKET_NAME)) <= MAX_SOCKET_PATH:
        return made
    made.rmdir()
    return Path(tempfile.mkdtemp(prefix="fedgpu-factory-", dir="/tmp"))


class LocalFactory:
    """A factory process of this agent's own, started with the agent and ended with it."""

    def __init__(self, env: Mapping[str, str] | None = None, cpu_slots: int = 0) -> None:
        self._env = {k: v for k, v in (env or os.environ).items() if k not in ROUND_ENV_KEYS}
        self._cpu_slots = cpu_slots
        # Private to this user: the factory refuses a socket directory anyone else can open.
        self.dir = socket_dir()
        self.path = self.dir / SOCKET_NAME
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start it (again, if it died); returns at once, it gets ready in the background.

        Linux signals a child when the *thread* that started it ends: the first start comes
        from the thread that runs the agent (or the process, for many agents), which lives as
        long as they do.
        """
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return
            if self._proc is not None:
                log.warning("the worker factory exited with %s; starting it again",
                            self._proc.returncode)
            cmd = [sys.executable, "-m", "fedgpu.node.rounds.factory", "--socket", str(self.path),
                   "--cpu-slots", str(self._cpu_slots)]
            # It ends with us, even if we are SIGKILLed (fedgpu.core.lifetime).
            self._proc = subprocess.Popen(cmd, env=child_env(self._env))

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                # Short: the whole node is gone within lifetime.STOP_LIMIT_S.
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class FactoryClient:
    """Asks one factory for workers; thread-safe (the agents of one process share it)."""

    def __init__(self, path: Path, own: LocalFactory | None = None) -> None:
        self.path = Path(path)
        self._own = own
        self._closed = False
        self._down = False
        self._live: set[Any] = set()
        self._lock = threading.Lock()

    @classmethod
    def start_own(cls, env: Mapping[str, str] | None = None, cpu_slots: int = 0
                  ) -> FactoryClient:
        own = LocalFactory(env, cpu_slots)
        own.start()
        return cls(own.path, own)

    @classmethod
    def for_node(cls, address: Path | None) -> FactoryClient | None:
        """The factory at `address` (another process's), else one of its own; None: none
        could start (rounds then run each in a freshly spawned worker)."""
        if address is not None:
            log.info("round workers come from the worker factory at %s", address)
            return cls(address)
        try:
            return cls.start_own()
        except OSError as exc:
            log.warning("cannot start a worker factory: %s", exc)
            return None

    @property
    def shared(self) -> bool:
        return self._own is None

    def spawn(self, *, workdir: Path, env: Mapping[str, str], node: str, need: Need,
              torch_threads: int | None, warm: dict[str, Any] | None = None,
              output: int | None = None) -> FactoryWorker:
        """A worker for this round, once a slot is free (this blocks while it waits).

        Raises FactoryUnavailable when there is none to be had from the factory.
        """
        sock = self._connect()
        with self._lock:
            if self._closed:
                sock.close()
                raise FactoryUnavailable("the agent is stopping", fallback=False)
            self._live.add(sock)
        reader = wire.Reader()
        msg: dict[str, Any] | None = None
        try:
            sock.settimeout(10)
            out = sys.stdout.fileno() if output is None else output
            err = sys.stderr.fileno() if output is None else output
            wire.send(sock, {
                "op": wire.Op.SPAWN, "workdir": str(Path(workdir).resolve()), "env": dict(env),
                "node": node, "device": need.device, "gpu_uuid": need.gpu_uuid,
                "gpu_share": need.gpu_share, "torch_threads": torch_threads, "warm": warm,
            }, fds=[out, err])
            # Queued behind other rounds for a slot: as long as it takes (the aggregator's
            # round deadline is the bound); a stop closes the socket and ends the wait.
            sock.settimeout(None)
            msg = wire.recv_one(sock, reader)
        except (OSError, wire.WireError) as exc:
            self._forget(sock)
            sock.close()
            raise FactoryUnavailable(f"the worker factory at {self.path} failed: {exc}",
                                     fallback=not self._closed) from None
        except BaseException:
            self._forget(sock)
            sock.close()  # the factory drops the request (or kills the worker) on our EOF
            raise
        if msg is None or msg.get("event") != wire.Event.STARTED:
            self._forget(sock)
            sock.close()
            if self._closed:
                raise FactoryUnavailable("the agent is stopping", fallback=False)
            why = (msg or {}).get("error") or "the worker factory closed the connection"
            raise FactoryUnavailable(str(why))
        return FactoryWorker(sock, reader, int(msg["pid"]), float(msg.get("queued_s") or 0.0),
                             on_close=self._forget)

    def _connect(self) -> socket.socket:
        wait = READY_TIMEOUT_S if self._own is not None else (0 if self._down else SHARED_WAIT_S)
        deadline = time.monotonic() + wait
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self.path))
                self._down = False
                return sock
            except OSError as exc:
                sock.close()
                if self._own is not None:
                    # Our own factory: (re)started if it died, then waited for while it imports.
                    self._own.start()
                if time.monotonic() >= deadline or self._closed:
                    self._down = True
                    raise FactoryUnavailable(f"cannot reach the worker factory at {self.path} "
                                             f"(waited {wait:.0f}s): {exc}") from None
                time.sleep(0.1)

    def _forget(self, obj: Any) -> None:
        key = obj._sock if isinstance(obj, FactoryWorker) else obj
        with self._lock:
            self._live.discard(key)

    def abort(self) -> None:
        """Stopping: every worker asked for through this client is killed, every wait ends."""
        with self._lock:
            self._closed = True
            live, self._live = list(self._live), set()
        for sock in live:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.abort()
        if self._own is not None:
            self._own.stop()
