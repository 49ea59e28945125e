"""`fedgpu run`: an aggregator and N nodes as local processes on loopback, no Docker.

The nodes live in as few processes as makes sense: `fedgpu node start-many` hosts up to
`nodes_per_process` of them each, and one worker factory (`python -m fedgpu.node.rounds.factory`)
forks every round's worker for all of them, within the host's CPU slots (fedgpu/cli/
local_nodes.py). Each node still has its own identity, data, registration and reports.

Every child runs in its own session so a Ctrl-C reaches only us; on SIGINT, SIGTERM or SIGHUP
we stop them all at once (SIGTERM, then SIGKILL to each child's process group after a grace
period), so nothing is left running. Killed with SIGKILL we cannot do that: each child asked the
kernel to be signalled when we die (fedgpu.core.lifetime), and stops on its own.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from fedgpu.cli.common.cross_site_text import matrix_lines
from fedgpu.cli.common.evaluation import site_lines
from fedgpu.cli.job.statistics_text import statistics_lines
from fedgpu.cli.run import cross_site
from fedgpu.cli.run.latest import link_latest
from fedgpu.cli.run.run_config import LocalRunConfig, demo_job, free_port
from fedgpu.cli.run.summary_lines import privacy_line, rounds_summary
from fedgpu.core import admin_client, lifetime
from fedgpu.core.errors import FedgpuError
from fedgpu.core.job import Job

# The run's settings and its job, kept apart (run_config.py); named here as well because
# benchmarks and tests import them from the launcher.
__all__ = ["LocalRun", "LocalRunConfig", "demo_job", "free_port", "run_local"]


class Proc:
    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str],
                 append: bool = False) -> None:
        self.name = name
        self.log_path = log
        self._log: TextIO = open(log, "a" if append else "w")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)

    def finish(self, deadline: float) -> int | None:
        """Wait until `deadline` (monotonic), then SIGKILL whatever of its group is left."""
        try:
            self.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # Its session's process group: also any worker it started and did not take down.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait()
        self._log.close()
        return self.popen.returncode

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""


class LocalRun:
    def __init__(self, cfg: LocalRunConfig, out: TextIO = sys.stdout) -> None:
        self.cfg = cfg
        self.out = out
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.run_dir = (cfg.run_dir or Path("runs") / stamp).resolve()
        self.procs: list[Proc] = []
        self.hosts: list[Proc] = []
        self.factory: Proc | None = None
        self.socket_dir: Path | None = None
        self.socket = Path()
        self.address = ""
        self.token = secrets.token_urlsafe(16)
        # The aggregator's operator token: what `fedgpu run` itself asks the status with.
        self.operator_token = secrets.token_urlsafe(16)
        self.last_rounds: dict[str, Any] | None = None
        self.total_rounds = cfg.job.rounds
        self.last_status: dict[str, Any] | None = None
        # --cross-site: the job queued after the training job, and its matrix when it ended.
        self.follow_up: str | None = None
        self.cross_site: dict[str, Any] | None = None

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        # Each child ends with us, even if we are SIGKILLed (see fedgpu.core.lifetime).
        env = lifetime.child_env(os.environ)
        # The token travels in the environment, not argv, so `ps` does not show it.
        env["FEDGPU_TOKEN"] = self.token
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("FEDGPU_OPERATOR_TOKEN", None)
        env.update(extra or {})
        return env

    def prepare(self) -> tuple[Path, list[Path]]:
        from fedgpu.cli.run.data import node_dirs
        from fedgpu.core.job.reader import dumps_job

        if self.cfg.nodes < 1:
            raise FedgpuError("--nodes must be at least 1")
        job = self.local_job()
        # A task bundle (run by these nodes: --task-approval any) trains on the node
        # data-directory format `fedgpu data split` makes, as `task new` writes.
        task = "digits" if job.task_dir is not None else job.task
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if self.cfg.run_dir is None:
            link_latest(self.run_dir)
        dirs = node_dirs(task, self.run_dir / "data", self.cfg.nodes, self.cfg.partition,
                         self.cfg.alpha, self.cfg.split_seed, self.cfg.data)
        path = self.run_dir / "job.toml"
        # The aggregator is handed the Job itself, written as a job file.
        path.write_text(dumps_job(job))
        return path, dirs

    def local_job(self) -> Job:
        """The job with the paths it names made absolute (its copy in the run directory
        must find them), its bundle checked and its task installed here."""
        from fedgpu.core.bundles import pack_dir
        from fedgpu.core.job import with_bundle_task
        from fedgpu.core.suggest import did_you_mean
        from fedgpu.node.tasks import available_tasks

        job, origin = self.cfg.job, self.cfg.job_file
        where = str(origin) if origin is not None else "fedgpu run"
        base = origin.parent if origin is not None else Path.cwd()
        if job.initial_weights is not None:
            job = replace(job, initial_weights=str((base / job.initial_weights).resolve()))
        if job.task_dir is not None:
            folder = (base / job.task_dir).resolve()
            # A `task` naming another task than the bundle's is refused here, with the file.
            job = with_bundle_task(job, pack_dir(folder).manifest.name, where)
            return replace(job, task_dir=str(folder))
        installed = available_tasks()
        if job.task not in installed:
            raise FedgpuError(
                f"{where}: task {job.task!r} is not installed here"
                f"{did_you_mean(job.task, installed)} (installed: {', '.join(installed)}); "
                "install its package or fix the name")
        return job

    def start(self, job: Path, dirs: list[Path]) -> None:
        from fedgpu.cli.run import local_nodes

        port = free_port()
        self.address = f"127.0.0.1:{port}"
        py = [sys.executable, "-m", "fedgpu.cli.app"]
        server = Proc("aggregator", [
            *py, "server", "start", "--job", str(job), "--host", "127.0.0.1",
            "--port", str(port), "--state-dir", str(self.run_dir / "state"),
            # Weights beside gRPC on a port of their own (the nodes find it at registration).
            "--bulk-port", str(free_port()), "--exit-when-done",
            *(["--tracking-uri", self.cfg.tracking_uri] if self.cfg.tracking_uri else []),
        ], self.run_dir / "logs" / "aggregator.log",
            self._env({"FEDGPU_OPERATOR_TOKEN": self.operator_token}))
        self.procs.append(server)
        self._wait_healthy(server)
        # A private directory (the factory refuses any other) with a short path: a Unix
        # socket's path is limited to about 100 bytes.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="fedgpu-run-"))
        self.socket = self.socket_dir / local_nodes.FACTORY_SOCKET
        self.factory = self._start_factory()
        ring = [free_port() for _ in dirs] if self.cfg.job.mode == "ring" else None
        split = self.cfg.data.resolve() if self.cfg.data else self.run_dir / "data"
        for host in local_nodes.hosts(len(dirs), self.cfg.nodes_per_process):
            cmd = local_nodes.host_cmd(
                host, address=self.address, split=split, socket=self.socket,
                logs=self.run_dir / "logs", gpu=self.cfg.gpu,
                torch_threads=self.cfg.torch_threads,
                gpu_memory_fraction=self.cfg.gpu_memory_fraction, ring_ports=ring,
                policy=cross_site.policy(self.run_dir) if self.cfg.cross_site else None)
            proc = Proc(host.name, cmd, self.run_dir / "logs" / f"{host.name}.log",
                        self._env(self.cfg.node_env))
            self.procs.append(proc)
            self.hosts.append(proc)
        if self.cfg.cross_site:
            self.follow_up = cross_site.submit(self.address, self.operator_token, self.cfg.job)
        self.say(f"aggregator on {self.address}; {len(dirs)} nodes started in "
                 f"{len(self.hosts)} process(es), round workers forked by one worker factory; "
                 f"logs in {self.run_dir / 'logs'}")

    def _start_factory(self, restart: bool = False) -> Proc:
        from fedgpu.cli.run import local_nodes

        proc = Proc("factory", local_nodes.factory_cmd(self.socket, self.cfg.cpu_slots),
                    self.run_dir / "logs" / "factory.log", self._env(self.cfg.node_env),
                    append=restart)
        self.procs.insert(1, proc)
        return proc

    def _check_factory(self) -> None:
        """A factory that died (killed, out of memory) is started again: rounds in flight
        failed with it, later ones fork from the new one (meanwhile nodes spawn their own)."""
        if self.factory is None or self.factory.alive():
            return
        self.say(f"warning: the worker factory exited with code {self.factory.popen.returncode};"
                 " starting it again")
        self.procs.remove(self.factory)
        self.factory.finish(time.monotonic())
        self.factory = self._start_factory(restart=True)

    def _wait_healthy(self, server: Proc, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not server.alive():
                raise FedgpuError(f"the aggregator exited at start:\n{server.tail()}")
            try:
                if admin_client.health(self.address, timeout=1) == "SERVING":
                    return
            except FedgpuError:
                pass
            time.sleep(0.2)
        raise FedgpuError(f"the aggregator did not become healthy in {timeout:.0f}s; see "
                          f"{server.log_path}")

    def watch(self) -> str:
        """Print progress until the aggregator exits; return the run's final state."""
        server = self.procs[0]
        shown, job = 0, None
        deadline = time.monotonic() + self.cfg.timeout_s
        warned: set[str] = set()
        while server.alive():
            if time.monotonic() > deadline:
                raise FedgpuError(f"the run did not finish within {self.cfg.timeout_s:.0f}s")
            try:
                self.last_status = admin_client.query(self.address, self.operator_token,
                                                      "GetStatus", 5)
                self.last_rounds = admin_client.query(self.address, self.operator_token,
                                                      "ListRounds", 5)
            except FedgpuError:
                time.sleep(0.3)
                continue
            history = self.last_rounds["rounds"]
            if self.last_rounds.get("job_id") != job:  # --cross-site: the next job's rounds
                shown, job = 0, self.last_rounds.get("job_id")
            while shown < len(history):
                self._show_round(history, shown)
                shown += 1
            for p in self.hosts:
                if not p.alive() and p.popen.returncode != 0 and p.name not in warned:
                    warned.add(p.name)
                    self.say(f"warning: {p.name} exited with code {p.popen.returncode}:\n"
                             f"{p.tail(5)}")
            if self.last_status["state"] in ("finished", "failed") and (
                    self.follow_up in (None, self.last_status.get("job_id"))):
                if self.follow_up is not None:  # --cross-site: its matrix, before the exit
                    self.cross_site = admin_client.query(self.address, self.operator_token,
                                                         "GetJob", 5, job_id=self.follow_up)
                break
            if self.hosts and not any(p.alive() for p in self.hosts):
                tails = "\n".join(f"--- {p.name}: {p.tail(3)}" for p in self.hosts)
                raise FedgpuError(f"every node exited before the run finished:\n{tails}")
            self._check_factory()
            time.sleep(0.5)
        state = (self.last_status or {}).get("state", "unknown")
        return state

    def _show_round(self, history: list[dict[str, Any]], i: int) -> None:
        r = history[i]
        if line := cross_site.round_line(r):
            return self.say(line)
        prev = history[i - 1]["eval"] if i > 0 and history[i - 1]["eval"] else (
            self.last_rounds or {}).get("initial_eval") if i == 0 else None
        acc = f"  accuracy before it {prev['accuracy']:.4f}" if prev and prev.get(
            "accuracy") is not None else ""
        loss = f"{r['train_loss']:.4f}" if r["train_loss"] is not None else "-"
        self.say(f"round {r['round']}/{self.total_rounds}: "
                 f"{r['status']}, train loss {loss}, {r['nodes_reporting']}/"
                 f"{len(r['participants'])} nodes, {r['duration_s']:.1f}s{acc}")

    def wait_for_exit(self, grace: float = 15.0) -> None:
        """Let nodes take their shutdown task and exit on their own before we stop them (the
        factory serves until it is told to stop)."""
        end = time.monotonic() + grace
        waiting = [p for p in self.procs if p.name != "factory"]
        while time.monotonic() < end and any(p.alive() for p in waiting):
            time.sleep(0.2)

    def stop_all(self, grace: float = 6.0) -> None:
        """Everything stopped within `grace` seconds (plus the kill): all asked at once."""
        # Nodes first (they were told to shut down and usually are gone already).
        for p in reversed(self.procs):
            p.terminate()
        deadline = time.monotonic() + grace
        for p in reversed(self.procs):
            p.finish(deadline)
        self.procs.clear()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def save_reports(self) -> None:
        for name, doc in (("status", self.last_status), ("rounds", self.last_rounds)):
            if doc is not None:
                (self.run_dir / f"{name}.json").write_text(json.dumps(doc, indent=2))


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP while the run is on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _hold_signals() -> None:
    # While we stop the children a second Ctrl-C must not cut that short (and leave orphans).
    for sig in _STOP_SIGNALS:
        if signal.getsignal(sig) is _interrupt:
            signal.signal(sig, signal.SIG_IGN)


def run_local(cfg: LocalRunConfig, out: TextIO = sys.stdout) -> int:
    run = LocalRun(cfg, out)
    job, dirs = run.prepare()
    # Explicitly: started by a script in the background, SIGINT was inherited as ignored.
    lifetime.handle_signals(_interrupt, _STOP_SIGNALS)
    try:
        run.start(job, dirs)
        state = run.watch()
        run.wait_for_exit()
    except KeyboardInterrupt as exc:
        _hold_signals()
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        run.say(f"interrupted ({signal.Signals(signum).name}): stopping every process of "
                "this run")
        run.stop_all()
        run.save_reports()
        return lifetime.exit_code(signum)
    finally:
        _hold_signals()
        run.stop_all()
    run.save_reports()
    if cfg.tracking_uri and run.last_rounds and run.last_rounds.get("job_id"):
        from fedgpu.cli.run.tracking import add_report

        run.say(add_report(cfg.tracking_uri, run.run_dir, str(run.last_rounds["job_id"])))
    rounds = (run.last_rounds or {}).get("rounds", [])
    last_eval = next((r["eval"] for r in reversed(rounds) if r.get("eval")), None)
    if state != "finished":
        err = (run.last_status or {}).get("error") or "see the logs"
        run.say(f"run {state}: {err}; logs in {run.run_dir / 'logs'}")
        return 1
    if last_eval and run.cfg.job.mode == "evaluate":
        run.say("\n".join(["the model on each site's held-out data:", *site_lines(last_eval)]))
    elif last_eval and last_eval.get("accuracy") is not None:
        run.say(f"final global model: accuracy {last_eval['accuracy']:.4f}, loss "
                f"{last_eval['loss']:.4f} on {last_eval['num_examples']} held-out examples "
                f"of {last_eval['nodes']} nodes")
    elif last_eval and last_eval.get("loss") is not None and any(
            "perplexity" in n.get("metrics", {}) for n in last_eval.get("per_node", [])):
        # A language model (causal-lm): perplexity of the examples-weighted mean loss.
        run.say(f"final global model: loss {last_eval['loss']:.4f}, perplexity "
                f"{math.exp(min(last_eval['loss'], 50.0)):.3f} on {last_eval['num_examples']} "
                f"held-out examples of {last_eval['nodes']} nodes")
    for line in matrix_lines((run.cross_site or {}).get("cross_site")):
        run.say(line)
    line = privacy_line(run.last_status or {})
    if line:
        run.say(line)
    for line in statistics_lines(rounds[-1].get("statistics") if rounds else None):
        run.say(line)
    run.say(f"run finished: {rounds_summary(rounds)}; run directory {run.run_dir}")
    return 0

