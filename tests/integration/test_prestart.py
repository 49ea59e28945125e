"""Pre-started round workers: ready before the task, told the GPU decision with the round.

The standby process imports torch before the round without touching CUDA; the round's GPU
decision (CUDA_VISIBLE_DEVICES by UUID, the memory cap) reaches it with the task, and every
round still runs in a process of its own that exits afterwards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.fixtures import fault_tasks
from tests.fixtures.fake_nvml import FakeNvml, fake_uuid
from tests.fixtures.federation import ROOT, Federation, write_job


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


def test_prestarted_worker_gets_the_rounds_gpu(fake_nvml: FakeNvml, federation: Federation,
                                               tmp_path: Path, digits_split: list[Path]
                                               ) -> None:
    fake_nvml.write([{"memory_total_mib": 16000, "memory_used_mib": 100}])
    env = _env(fake_nvml, tmp_path, ["report-env"] * 3)
    federation.start_server(write_job(tmp_path / "job.toml", task="faulty", rounds=3,
                                      min_nodes=1, use_gpu=True), "--heartbeat-s", "1")
    node = federation.start_node("n1", digits_split[0], "--gpu-memory-fraction", "0.4",
                                 env=env)
    assert federation.wait_state(("finished", "failed"))["state"] == "finished"
    seen = [json.loads(line) for line in (tmp_path / "env.jsonl").read_text().splitlines()]
    assert len(seen) == 3
    for entry in seen:
        assert entry["CUDA_VISIBLE_DEVICES"] == fake_uuid(0)
        assert entry["FEDGPU_DEVICE"] == "cuda:0"
        assert entry["FEDGPU_MEMORY_FRACTION"] == "0.4"
    # One process per round: each exits afterwards, so whatever it allocated is returned.
    assert len({e["pid"] for e in seen}) == 3
    log = node.text()
    assert log.count("pre-started worker: ready after") >= 3


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
    assert "pre-started worker" not in node.text()
