"""Many node agents in one process: what `fedgpu node start-many` (and so `fedgpu run`) runs.

Each node is a whole Agent — its own name, data directory, registration, GPU decision,
heartbeats, status file, and updates on the wire — in a thread of its own; the aggregator sees
exactly what it sees of separate processes. They share the process (one interpreter, one gRPC
runtime: tens of MB for all of them instead of ~60 MB each) and the host's worker factory, which
forks every round's worker. Threads suit an agent: it only waits (long polls, its round's
worker, uploads), and never trains.

With a log directory every node writes NAME.log — its agent's lines and its round workers'
output — as if it ran alone; lines of the process itself go to stderr.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from fedgpu.core.errors import FedgpuError
from fedgpu.node.agent import Agent
from fedgpu.node.agent_config import AgentConfig
from fedgpu.node.policy import EnforceError
from fedgpu.node.rounds.factory_client import FactoryClient

log = logging.getLogger("fedgpu.node.fleet")
# How long a stop waits for the agents' threads before the process exits under them.
STOP_GRACE_S = 5.0


class NodeLogs(logging.Handler):
    """Writes a record to the log file of the node whose thread logged it (threads are named
    NAME or NAME:role); records of other threads go to `fallback`."""

    def __init__(self, files: dict[str, TextIO], fallback: logging.Handler) -> None:
        super().__init__()
        self.files = files
        self.fallback = fallback

    def emit(self, record: logging.LogRecord) -> None:
        fh = self.files.get((record.threadName or "").split(":", 1)[0])
        if fh is None:
            self.fallback.handle(record)
            return
        try:
            fh.write(self.format(record) + "\n")
            fh.flush()
        except Exception:  # logging must never take a node down
            self.handleError(record)


class Fleet:
    """Run `configs` as agents in this process until they finish or `stop` is set."""

    def __init__(self, configs: list[AgentConfig], factory: FactoryClient | None,
                 log_dir: Path | None = None) -> None:
        if len({c.name for c in configs}) != len(configs):
            raise FedgpuError("every node of a fleet needs a name of its own")
        self.factory = factory
        self._files: dict[str, TextIO] = {}
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            for cfg in configs:
                # Line-buffered, appended: the agent's lines and its workers' output interleave
                # whole, in order.
                self._files[cfg.name] = open(log_dir / f"{cfg.name}.log", "a", buffering=1)  # noqa: SIM115
            configs = [replace(c, worker_output=self._files[c.name].fileno()) for c in configs]
        self.agents = [Agent(cfg, factory) for cfg in configs]
        self.codes: dict[str, int] = {}
        self._threads: list[threading.Thread] = []

    def install_logs(self, formatter: logging.Formatter) -> None:
        """Route the agents' log lines to their nodes' files (when there is a log directory)."""
        if not self._files:
            return
        root = logging.getLogger()
        fallback = root.handlers[0] if root.handlers else logging.StreamHandler()
        router = NodeLogs(self._files, fallback)
        router.setFormatter(formatter)
        root.handlers = [router]

    def run(self, stop: threading.Event) -> int:
        for agent in self.agents:
            t = threading.Thread(target=self._run_one, args=(agent,), name=agent.cfg.name,
                                 daemon=True)
            t.start()
            self._threads.append(t)
        log.info("%d node agents started in process %d", len(self.agents), os.getpid())
        while any(t.is_alive() for t in self._threads) and not stop.wait(0.5):
            pass
        if stop.is_set():
            self.shutdown()
        failed = sorted(n for n, c in self.codes.items() if c != 0)
        if failed:
            log.error("%d node(s) ended with an error: %s", len(failed), ", ".join(failed))
        return 1 if failed else 0

    def _run_one(self, agent: Agent) -> None:
        try:
            code = agent.run()
        except (FedgpuError, EnforceError) as exc:
            log.error("%s", exc)
            code = getattr(exc, "exit_code", 1)
        except Exception:
            log.exception("the agent stopped on an unexpected error")
            code = 1
        self.codes[agent.cfg.name] = code

    def shutdown(self) -> None:
        """Stop every agent: long polls end, every worker asked for is killed by the factory."""
        for agent in self.agents:
            agent.shutdown()
        if self.factory is not None:
            self.factory.abort()
        deadline = time.monotonic() + STOP_GRACE_S
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self.factory is not None:
            self.factory.close()
        for fh in self._files.values():
            fh.close()
