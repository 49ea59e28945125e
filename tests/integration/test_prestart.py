"""Pre-started round workers: forked by the worker factory, told the GPU decision with the round.

The factory imports torch before the round without touching CUDA; a worker it forks reports no
CUDA initialised when its task begins, gets the round's GPU decision (CUDA_VISIBLE_DEVICES by
UUID, the memory cap), and every round runs in a process of its own that exits afterwards.
Against the fake libnvidia-ml.so.1, so the GPU path is the real one.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import psutil

from tests.fixtures import fault_tasks
from tests.fixtures.fake_nvml import FakeNvml, fake_uuid
from tests.fixtures.federation import ROOT, Federation, write_job
from tests.fixtures.processes import descendants, is_factory


def _env(fake_nvml: FakeNvml, tmp: Path, script: list[str]) -> dict[str, str]:
    tasks = fault_tasks.install(tmp / "tasks")
    (tmp / "script").write_text("".join(f"{line}\n" for line in script))
    return fake_nvml.env({
        "FEDGPU_TOKEN": "test-token", "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{tasks}{os.pathsep}{ROOT}", "FEDGPU_SIMULATED_GPUS": "1",
        fault_tasks.SCRIPT_ENV: str(tmp / "script"),
        "FEDGPU_TEST_ENVFILE": str(tmp / "env.jsonl"),
        # The agent's own view must not leak into the worker: the round's decision wins.
        "CUDA_VISIBLE_DEVICES": "0",
    })


def test_a_factory_worker_starts_without_cuda_and_gets_the_rounds_gpu(
        fake_nvml: FakeNvml, federation: Federation, tmp_path: Path,
        digits_split: list[Path]) -> None:
    fake_nvml.write([{"memory_total_mib": 16000, "memory_used_mib": 100}])
    env = _env(fake_nvml, tmp_path, ["report-env"] * 3)
    federation.start_server(write_job(tmp_path / "job.toml", task="faulty", rounds=3,
                                      min_nodes=1, use_gpu=True), "--heartbeat-s", "1")
    node = federation.start_node("n1", digits_split[0], "--gpu-memory-fraction", "0.4",
                                 env=env)
    # While it serves, the factory stays single-threaded: the only state it may fork from.
    threads: set[int] = set()
    end = time.monotonic() + 240
    while federation.query("GetStatus")["state"] not in ("finished", "failed"):
        assert time.monotonic() < end, node.text()[-3000:]
        for p in descendants(node.popen.pid):
            if is_factory(p):
                try:
                    threads.add(p.num_threads())
                except psutil.Error:
                    pass
        time.sleep(0.2)
    assert federation.query("GetStatus")["state"] == "finished"
    assert threads == {1}
    seen = [json.loads(line) for line in (tmp_path / "env.jsonl").read_text().splitlines()]
    assert len(seen) == 3
    log = node.text()
    factory_pid = int(re.search(r"worker factory ready on \S+ \(pid (\d+)", log).group(1))
    for entry in seen:
        assert entry["CUDA_VISIBLE_DEVICES"] == fake_uuid(0)
        assert entry["FEDGPU_DEVICE"] == "cuda:0"
        assert entry["FEDGPU_MEMORY_FRACTION"] == "0.4"
        # Nothing initialised CUDA before the task: its context will be its own.
        assert entry["cuda_initialized"] is False and entry["libcuda_loaded"] is False
        assert entry["ppid"] == factory_pid and entry["comm"] == "fedgpu-round"
        assert f"worker pid {entry['pid']} forked by the factory {factory_pid}: CUDA " \
               "initialised before the task: no" in log
    # One process per round, and each had exited before the next round's began.
    pids = [e["pid"] for e in seen]
    assert len(set(pids)) == 3
    for this, after in zip(pids, pids[1:], strict=False):
        assert log.index(f"worker {this} for n1 exited with 0") < log.index(
            f"worker {after} for n1 started")
    assert not any(psutil.pid_exists(p) for p in pids)


def test_no_prestart_spawns_at_the_round(fake_nvml: FakeNvml, federation: Federation,
                                         tmp_path: Path, digits_split: list[Path]) -> None:
    fake_nvml.write([{"memory_total_mib": 16000, "memory_used_mib": 100}])
    env = _env(fake_nvml, tmp_path, ["report-env"])
    federation.start_server(write_job(tmp_path / "job.toml", task="faulty", rounds=1,
                                      min_nodes=1, use_gpu=False), "--heartbeat-s", "1")
    node = federation.start_node("n1", digits_split[0], "--no-prestart", env=env)
    assert federation.wait_state(("finished", "failed"))["state"] == "finished"
    seen = [json.loads(line) for line in (tmp_path / "env.jsonl").read_text().splitlines()]
    # The job does not ask for a GPU: the GPU is hidden from the round's process.
    assert seen[0]["CUDA_VISIBLE_DEVICES"] == "" and seen[0]["FEDGPU_DEVICE"] == "cpu"
    # A fresh `python -m fedgpu.node.rounds.worker`, the agent's own child.
    assert seen[0]["ppid"] == node.popen.pid and seen[0]["comm"] != "fedgpu-round"
    assert "worker factory" not in node.text()
