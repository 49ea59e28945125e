"""Every process fedgpu starts ends with its parent (issue 13, item 8), checked with psutil on
the real process trees: `fedgpu run` stopped by a signal, `fedgpu run` or a node agent killed
with SIGKILL (no handler runs: the children must notice by themselves)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.fixtures.federation import (
    FEDGPU,
    ROOT,
    Federation,
    Proc,
    base_env,
    free_port,
    write_job,
)
from tests.fixtures.processes import (
    cmdline_has,
    descendants,
    describe,
    is_factory,
    kill_all,
    read_until,
    wait_gone,
    with_signals,
)
from tests.integration.test_faults import faulty_env, wait_for

# Real process trees trained, signalled and killed: minutes in all.
pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

FACTORY = "fedgpu.node.rounds.factory"
RING_WORKER = "fedgpu.node.ring_worker"


@pytest.fixture
def local_run(tmp_path: Path) -> Iterator[callable]:
    """Starts `fedgpu run ARGS` with SIGTERM, SIGHUP and SIGINT at their defaults; whatever it
    started is killed at the end if a test left anything behind."""
    started: list[subprocess.Popen[str]] = []
    seen: list[psutil.Process] = []

    def start(*args: str) -> subprocess.Popen[str]:
        cmd = [*FEDGPU, "run", "--nodes", "2", "--run-dir", str(tmp_path / "run"), *args]
        p = subprocess.Popen(
            with_signals(cmd, default=(signal.SIGTERM, signal.SIGHUP, signal.SIGINT)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=base_env(),
            cwd=ROOT)
        started.append(p)
        return p

    start.seen = seen  # type: ignore[attr-defined]
    yield start
    for p in started:
        seen.extend(descendants(p.pid))
        if p.poll() is None:
            p.kill()
            p.wait()
    kill_all(seen)


def whole_tree(run: subprocess.Popen[str], want: str, count: int,
               timeout: float = 120) -> list[psutil.Process]:
    """The run's descendants once `count` of them run `want` (aggregator and agents too)."""
    end = time.monotonic() + timeout
    tree: list[psutil.Process] = []
    while time.monotonic() < end:
        tree = descendants(run.pid)
        if sum(cmdline_has(p, want) for p in tree) >= count:
            return tree
        assert run.poll() is None, run.stdout.read() if run.stdout else ""
        time.sleep(0.05)
    raise AssertionError(f"never {count} x {want} under fedgpu run:\n{describe(tree)}")


def check_tree(tree: list[psutil.Process]) -> None:
    # The aggregator, one agent process hosting both nodes, the host's worker factory.
    assert sum(cmdline_has(p, "server start") for p in tree) == 1, describe(tree)
    assert sum(cmdline_has(p, "node start-many") for p in tree) == 1, describe(tree)
    assert sum(is_factory(p) for p in tree) == 1, describe(tree)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_run_stops_everything_it_started_on_a_signal(local_run, sig: int) -> None:
    run = local_run("--rounds", "50")
    read_until(run, "round 1/50", 240)
    tree = whole_tree(run, FACTORY, 1)
    check_tree(tree)
    local_run.seen.extend(tree)
    signalled = time.monotonic()
    run.send_signal(sig)
    out, _ = run.communicate(timeout=30)
    assert run.returncode == 128 + sig, out
    assert f"interrupted ({signal.Signals(sig).name}): stopping every process" in out
    left = wait_gone(tree, timeout=max(0.0, signalled + 10 - time.monotonic()))
    assert not left, f"still running 10 s after {signal.Signals(sig).name}:\n{describe(left)}"


@pytest.mark.parametrize("mode", ["star", "ring"])
def test_children_of_a_killed_run_end_on_their_own(local_run, mode: str) -> None:
    run = local_run("--rounds", "50", "--mode", mode)
    # Ring mode: killed while a block's torch.distributed workers run.
    tree = (whole_tree(run, RING_WORKER, 1, timeout=240) if mode == "ring"
            else (read_until(run, "round 1/50", 240), whole_tree(run, FACTORY, 1))[1])
    check_tree(tree)
    local_run.seen.extend(tree)
    killed = time.monotonic()
    run.kill()  # SIGKILL: `fedgpu run` itself gets no chance to stop anything
    run.wait()
    left = wait_gone(tree, timeout=max(0.0, killed + 10 - time.monotonic()))
    assert not left, f"still running 10 s after fedgpu run was killed:\n{describe(left)}"


def test_workers_end_when_their_agent_is_killed(federation: Federation, tmp_path: Path,
                                               digits_split: list[Path]) -> None:
    job = write_job(tmp_path / "job.toml", task="faulty", rounds=1, min_nodes=1,
                    round_deadline_s=300, evaluate=False)
    federation.start_server(job, "--heartbeat-s", "1")
    agent = federation.start_node("node-a", digits_split[0],
                                  env=faulty_env(tmp_path, "node-a", "sleep 300\n"))
    pid_file = tmp_path / "node-a.worker.pid"
    wait_for("training to start", pid_file.exists, 120, federation)
    training = psutil.Process(int(pid_file.read_text()))
    # The agent's worker factory, and the round's worker it forked (mid-training).
    children = descendants(agent.popen.pid)
    assert training in children
    assert sum(is_factory(p) for p in children) == 1, describe(children)
    try:
        killed = time.monotonic()
        agent.popen.kill()
        agent.popen.wait()
        left = wait_gone(children, timeout=max(0.0, killed + 10 - time.monotonic()))
        assert not left, f"still running 10 s after the agent was killed:\n{describe(left)}"
    finally:
        kill_all(children)


def test_a_child_whose_parent_died_before_it_could_bind_ends_at_once(tmp_path: Path) -> None:
    # The parent exits at once; the child asks for the death signal only 2 s later, when the
    # kernel can no longer send it: the pid the parent left in its environment tells.
    child = ("import time; time.sleep(2); from fedgpu.core import lifetime; "
             "bound = lifetime.bind_to_parent(); print('bound', bound, flush=True); "
             "time.sleep(120)")
    parent = ("import subprocess, sys; from fedgpu.core import lifetime; "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}], "
              "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, "
              "env=lifetime.child_env() if sys.argv[1] == 'bound' else None); print(p.pid)")
    pids = {}
    for how in ("bound", "free"):
        out = subprocess.run([sys.executable, "-c", parent, how], capture_output=True,
                             text=True, env=base_env(), cwd=ROOT, timeout=60, check=True)
        pids[how] = psutil.Process(int(out.stdout.strip()))
    try:
        assert not wait_gone([pids["bound"]], timeout=10)
        # Without a parent's request nothing binds (a node started by a person runs on).
        time.sleep(3)
        assert wait_gone([pids["free"]], timeout=0) == [pids["free"]]
    finally:
        kill_all(pids.values())


def test_a_stopped_process_ends_even_when_a_thread_holds_its_exit() -> None:
    # A thread stuck in a blocking call (a transfer retrying until its resume window closes)
    # keeps the interpreter's exit waiting; exit_within ends the process anyway, with its code.
    code = ("import signal, sys, threading, time; from fedgpu.core import lifetime\n"
            "threading.Thread(target=time.sleep, args=(600,)).start()\n"
            "def stop(signum, frame):\n"
            "    lifetime.exit_within(float(sys.argv[1]), 3)\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop); print('ready', flush=True); time.sleep(600)")
    for limit, ends in ((1.0, True), (60.0, False)):
        p = subprocess.Popen([sys.executable, "-c", code, str(limit)], stdout=subprocess.PIPE,
                             text=True, env=base_env(), cwd=ROOT)
        try:
            assert p.stdout.readline().strip() == "ready"
            p.send_signal(signal.SIGTERM)
            try:
                got = p.wait(timeout=6)
            except subprocess.TimeoutExpired:
                got = None
            # Without the cut the non-daemon thread holds the exit: the control case.
            assert (got == 3) if ends else got is None, (limit, got)
        finally:
            p.kill()
            p.wait()


def test_child_env_names_this_process() -> None:
    from fedgpu.core import lifetime

    env = lifetime.child_env({"A": "1"})
    assert env == {"A": "1", lifetime.PARENT_ENV: str(os.getpid())}


def test_aggregator_and_agent_stop_on_ctrl_c_even_when_started_with_it_ignored(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    # A script's `cmd &` starts both with SIGINT ignored; each installs its handler itself.
    port = free_port()
    federation.address = f"127.0.0.1:{port}"
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("server", "node")}  # noqa: SIM115
    server = subprocess.Popen(with_signals(
        [*FEDGPU, "server", "start", "--job", str(write_job(tmp_path / "job.toml")), "--host",
         "127.0.0.1", "--port", str(port)], ignored=(signal.SIGINT,)),
        stdout=logs["server"], stderr=subprocess.STDOUT, env=base_env(FEDGPU_TOKEN="test-token"),
        cwd=ROOT)
    node = None
    try:
        federation.wait_healthy(Proc("aggregator", server, tmp_path / "server.log"))
        node = subprocess.Popen(with_signals(
            [*FEDGPU, "node", "start", "--aggregator", federation.address, "--data",
             str(digits_split[0]), "--name", "node-a", "--gpu", "none", "--status-file",
             str(tmp_path / "node.status")], ignored=(signal.SIGINT,)),
            stdout=logs["node"], stderr=subprocess.STDOUT,
            env=base_env(FEDGPU_TOKEN="test-token"), cwd=ROOT)
        wait_for("the node to register", lambda: federation.query("ListNodes")["nodes"], 120)
        wait_for("its worker factory", lambda: any(
            cmdline_has(p, FACTORY) for p in descendants(node.pid)), 60)
        tree = descendants(node.pid)
        node.send_signal(signal.SIGINT)
        assert node.wait(timeout=20) == 130, (tmp_path / "node.log").read_text()[-2000:]
        assert "SIGINT: stopped" in (tmp_path / "node.log").read_text()
        assert not wait_gone(tree, timeout=10), describe(tree)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=20) == 0, (tmp_path / "server.log").read_text()[-2000:]
        assert "shutting down on signal" in (tmp_path / "server.log").read_text()
    finally:
        for p in (server, node):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for fh in logs.values():
            fh.close()
