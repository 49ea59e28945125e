"""Many nodes on one host: the shared worker factory, its slots, agent processes hosting several
nodes (`node start-many`), and what happens when an agent process or the factory is killed in
the middle of a round. Real processes on loopback throughout."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.fixtures import fault_tasks
from tests.fixtures.federation import FEDGPU, ROOT, Federation, base_env, write_job
from tests.fixtures.processes import descendants, describe, is_factory, kill_all, wait_gone
from tests.integration.test_faults import wait_for

pytestmark = pytest.mark.timeout(420)
FACTORY = "fedgpu.node.rounds.factory"


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    tasks = fault_tasks.install(tmp / "tasks")
    return base_env(FEDGPU_TOKEN="test-token", PYTHONPATH=f"{tasks}{os.pathsep}{ROOT}",
                    **extra)


def _worker_pids(log: str) -> dict[int, str]:
    """pid -> node, from the factory's 'worker PID for NODE started' lines."""
    return {int(pid): node for pid, node in
            re.findall(r"worker (\d+) for (\S+) started", log)}


@pytest.fixture
def split4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fedgpu.core.datasets import split_digits

    out = tmp_path_factory.mktemp("digits4")
    split_digits(out, 4, "iid", 0.5, 0)
    return out


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Short (a socket path has ~100 bytes) and private: mkdtemp makes it 0700.
    d = Path(tempfile.mkdtemp(prefix="fedgpu-test-"))
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def test_one_slot_queues_four_nodes_and_the_wait_shows_in_their_updates(tmp_path: Path,
                                                                        split4: Path) -> None:
    intervals = tmp_path / "intervals.jsonl"
    job = write_job(tmp_path / "job.toml", task="faulty", rounds=2, min_nodes=4,
                    round_deadline_s=120)
    env = _env(tmp_path, **{fault_tasks.SLEEP_ENV: "0.4",
                            fault_tasks.INTERVALS_ENV: str(intervals)})
    run_dir = tmp_path / "run"
    r = subprocess.run([*FEDGPU, "run", "--nodes", "4", "--job", str(job), "--cpu-slots", "1",
                        "--data", str(split4), "--run-dir", str(run_dir)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    # The job says how many rounds: 2, not '?'.
    assert re.search(r"round 1/2: finished, .* 4/4 nodes", r.stdout), r.stdout
    assert re.search(r"round 2/2: finished, .* 4/4 nodes", r.stdout), r.stdout
    # One slot: no two rounds' training ever overlapped.
    runs = sorted((json.loads(line) for line in intervals.read_text().splitlines()),
                  key=lambda x: x["start"])
    assert len(runs) == 8
    for before, after in zip(runs, runs[1:], strict=False):
        assert after["start"] >= before["end"] - 0.01, (before, after)
    # ... and the nodes that waited for it say so in their updates.
    rounds = json.loads((run_dir / "rounds.json").read_text())["rounds"]
    for rnd in rounds:
        queued = sorted(u["resources"]["queued_seconds"] for u in rnd["updates"])
        assert len(queued) == 4
        # Three of four waited behind at least one 0.4 s training run, the last behind three.
        assert queued[1] >= 0.3 and queued[3] >= 1.0, queued
        for u in rnd["updates"]:
            assert u["resources"]["round_seconds"] >= u["resources"]["queued_seconds"]


def test_twelve_nodes_sampling_a_quarter_stay_light(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p = subprocess.Popen([*FEDGPU, "run", "--nodes", "12", "--rounds", "2", "--fraction", "0.25",
                          "--nodes-per-process", "6", "--run-dir", str(run_dir)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=base_env(), cwd=ROOT)
    peak, seen = 0, []
    try:
        while p.poll() is None:
            tree = [psutil.Process(p.pid), *descendants(p.pid)]
            seen.extend(tree)
            rss = 0
            for proc in tree:
                try:
                    rss += proc.memory_info().rss
                except psutil.Error:
                    continue
            peak = max(peak, rss)
            time.sleep(0.5)
        out = p.stdout.read() if p.stdout else ""
    finally:
        if p.poll() is None:
            p.kill()
        kill_all(seen)
    assert p.returncode == 0, out
    assert "12 nodes started in 2 process(es)" in out
    assert re.search(r"round 2/2: finished, .* 3/3 nodes", out), out
    rounds = json.loads((run_dir / "rounds.json").read_text())["rounds"]
    assert [len(r["participants"]) for r in rounds] == [3, 3]
    for i in range(1, 13):
        assert (run_dir / "logs" / f"node-{i}.log").stat().st_size > 0
        status = json.loads((run_dir / "logs" / f"node-{i}.status.json").read_text())
        assert status["name"] == f"node-{i}"
    assert len({u["node"] for r in rounds for u in r["updates"]}) >= 3
    # 12 agents and 12 idle pre-started workers would hold ~4 GB; one factory and two agent
    # processes hold a fraction of that (RSS summed, so shared pages count in every process).
    assert peak < 3 << 30, f"peak RSS of the run's processes: {peak >> 20} MiB"


def _host(fed: Federation, name: str, split: Path, first: int, count: int, socket: Path,
          env: dict[str, str]) -> None:
    fed.spawn(name, ["node", "start-many", "--aggregator", fed.address, "--split", str(split),
                     "--first", str(first), "--count", str(count), "--torch-threads", "1",
                     "--worker-factory", str(socket), "--gpu", "none",
                     "--status-dir", str(fed.tmp)], env=env)


def test_killing_an_agent_process_mid_round_fails_only_its_nodes(
        federation: Federation, tmp_path: Path, split4: Path, socket_dir: Path) -> None:
    env = _env(tmp_path, **{fault_tasks.SLEEP_ENV: "1.5"})
    sock = socket_dir / "f.sock"
    factory = federation.spawn("factory", ["node", "factory", "--socket", str(sock),
                                           "--cpu-slots", "2"], env=env)
    job = write_job(tmp_path / "job.toml", task="faulty", rounds=3, min_nodes=2,
                    round_deadline_s=25, evaluate=False)
    federation.start_server(job, "--heartbeat-s", "1")
    _host(federation, "host-a", split4, 1, 2, sock, env)
    _host(federation, "host-b", split4, 3, 2, sock, env)
    host_a = federation.procs[-2]
    workers: list[psutil.Process] = []

    def host_a_training() -> bool:
        # A live one: a worker logged a moment ago may already have ended (a round without
        # the task's sleep, such as the initial model's, takes a fraction of a second).
        workers.clear()
        for pid, n in _worker_pids(factory.text()).items():
            if n in ("node-1", "node-2"):
                try:
                    workers.append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    continue
        return bool(workers)

    wait_for("a worker of host-a's nodes to train", host_a_training, 180, federation)
    killed = time.monotonic()
    host_a.popen.kill()
    host_a.popen.wait()
    try:
        left = wait_gone(workers, timeout=max(0.0, killed + 10 - time.monotonic()))
        assert not left, f"workers of a killed agent still run after 10 s:\n{describe(left)}"
        assert factory.popen.poll() is None, "the factory must outlive an agent"
        assert federation.wait_state(("finished", "failed"), timeout=300)["state"] == "finished"
    finally:
        kill_all(workers)
    rounds = federation.query("ListRounds")["rounds"]
    assert [r["round"] for r in rounds if r["status"] == "finished"] == [1, 2, 3]
    first = next(r for r in rounds if r["status"] == "finished")
    # The round the agent died in closed with the other agent's nodes; nothing else was lost.
    assert sorted(u["node"] for u in first["updates"]) == ["node-3", "node-4"]
    assert all(sorted(u["node"] for u in r["updates"]) == ["node-3", "node-4"]
               for r in rounds if r["status"] == "finished")


def test_killing_the_factory_mid_round_fails_that_round_and_the_run_goes_on(
        tmp_path: Path, digits_split: list[Path]) -> None:
    job = write_job(tmp_path / "job.toml", task="faulty", rounds=3, min_nodes=3,
                    round_deadline_s=120, evaluate=False)
    env = _env(tmp_path, **{fault_tasks.SLEEP_ENV: "1.5"})
    run_dir = tmp_path / "run"
    p = subprocess.Popen([*FEDGPU, "run", "--nodes", "3", "--job", str(job), "--data",
                          str(digits_split[0].parent), "--run-dir", str(run_dir)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         cwd=ROOT)
    seen: list[psutil.Process] = []
    try:
        log = run_dir / "logs" / "factory.log"
        found: list[psutil.Process] = []

        aggregator_log = run_dir / "logs" / "aggregator.log"

        def training() -> bool:
            # The factory with a worker of a training round alive now: one logged a moment
            # ago may have ended already, and a kill during the initial model's round would
            # only move that round to another node (it is not one of the rounds listed).
            found.clear()
            if not log.exists() or not aggregator_log.exists() or \
                    "(train, attempt" not in aggregator_log.read_text():
                return False
            logged = _worker_pids(log.read_text())
            try:
                for proc in descendants(p.pid):
                    if is_factory(proc):
                        live = [x for x in proc.children() if x.pid in logged]
                        if live:
                            found.extend([proc, *live])
                            return True
            except psutil.Error:
                return False
            return False

        wait_for("a round to train", training, 240)
        seen.extend(descendants(p.pid))
        factory, *workers = found
        factory.kill()
        assert not wait_gone(workers, timeout=10), "workers outlived their factory"
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
        seen.extend(descendants(p.pid))
        kill_all(seen)
    assert p.returncode == 0, out
    assert "the worker factory exited with code -9; starting it again" in out
    rounds = json.loads((run_dir / "rounds.json").read_text())["rounds"]
    failed = [f for r in rounds for f in r.get("failures", [])]
    assert failed and all("worker factory" in f["error"] for f in failed), failed
    assert [r["round"] for r in rounds if r["status"] == "finished"] == [1, 2, 3]


def test_the_factory_refuses_a_socket_directory_others_can_open(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    r = subprocess.run([*FEDGPU[:1], "-m", FACTORY, "--socket", str(shared / "f.sock")],
                       capture_output=True, text=True, env=base_env(), cwd=ROOT, timeout=60)
    assert r.returncode != 0
    assert "must belong to uid" in r.stderr and "chmod 700" in r.stderr
    assert not (shared / "f.sock").exists()
    # A directory that does not exist yet is made private.
    fresh = tmp_path / "fresh" / "run"
    p = subprocess.Popen([*FEDGPU[:1], "-m", FACTORY, "--socket", str(fresh / "f.sock")],
                         stderr=subprocess.DEVNULL, env=base_env(), cwd=ROOT)
    try:
        wait_for("the factory to listen", (fresh / "f.sock").exists, 120)
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    finally:
        p.terminate()
        p.wait(timeout=20)


def test_sigterm_stops_the_factory_and_removes_its_socket(socket_dir: Path,
                                                          tmp_path: Path) -> None:
    sock = socket_dir / "f.sock"
    p = subprocess.Popen([*FEDGPU[:1], "-m", FACTORY, "--socket", str(sock)],
                         stderr=subprocess.PIPE, text=True, env=base_env(), cwd=ROOT)
    try:
        wait_for("the factory to listen", sock.exists, 120)
        assert psutil.Process(p.pid).num_threads() == 1
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not sock.exists()


def test_run_refuses_sampling_flags_it_cannot_honour(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.toml")
    for args, error in [
        (["--job", str(job), "--fraction", "0.5"], "with --job set fraction and min_nodes"),
        (["--fraction", "1.5"], "--fraction must be in (0, 1]"),
        (["--nodes", "3", "--min-nodes", "5"], "--min-nodes must be between 1 and --nodes (3)"),
    ]:
        r = subprocess.run([*FEDGPU, "run", *args, "--run-dir", str(tmp_path / "run")],
                           capture_output=True, text=True, env=base_env(), cwd=ROOT, timeout=60)
        assert r.returncode == 2 and error in r.stderr, r.stderr
        assert not (tmp_path / "run").exists()
