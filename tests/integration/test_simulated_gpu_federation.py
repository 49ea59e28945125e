"""Whole federations whose nodes see simulated GPUs through the fake libnvidia-ml.so.1.

The node agents load the real nvidia-ml-py bindings against the fake library; their GPU
decisions and the NVML memory figures they measure must reach the aggregator unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from tests.fixtures import fault_tasks
from tests.fixtures.fake_nvml import FakeNvml, fake_uuid, write_inventory
from tests.fixtures.federation import FEDGPU, ROOT, Federation, write_job


def test_fedgpu_run_three_nodes_share_one_simulated_gpu(fake_nvml: FakeNvml,
                                                        tmp_path: Path) -> None:
    fake_nvml.write([{"memory_total_mib": 81559, "memory_used_mib": 1234,
                      "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}])
    env = fake_nvml.env({"FEDGPU_SIMULATED_GPUS": "1", "PYTHONUNBUFFERED": "1"})
    run_dir = tmp_path / "run"
    r = subprocess.run([*FEDGPU, "run", "--nodes", "3", "--rounds", "2", "--run-dir",
                        str(run_dir), "--gpu", "offer", "--gpu-memory-fraction", "0.3"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rounds = json.loads((run_dir / "rounds.json").read_text())["rounds"]
    assert len(rounds) == 2
    for rnd in rounds:
        assert rnd["nodes_reporting"] == 3
        for u in rnd["updates"]:
            d = u["gpu_decision"]
            assert d["device"] == "cuda" and d["use_gpu"] is True
            assert d["gpu_uuid"] == fake_uuid(0) and d["gpu_name"] == "NVIDIA H100 80GB HBM3"
            assert d["memory_fraction"] == 0.3
            assert "free" in d["reason"]
            res = u["resources"]
            assert res["device"] == "cuda" and res["gpu_uuid"] == fake_uuid(0)
            assert res["nvml_used_before_mib"] == 1234
            assert res["nvml_used_peak_mib"] == 1234
            assert res["nvml_used_after_mib"] == 1234
    log = (run_dir / "logs" / "node-1.log").read_text()
    assert "gpu-decision mode=offer use_gpu=true device=cuda" in log
    assert "FEDGPU_SIMULATED_GPUS=1" in log


def test_each_node_decides_on_its_own_inventory(fake_nvml: FakeNvml, federation: Federation,
                                                tmp_path: Path, digits_split: list[Path]
                                                ) -> None:
    inv = {name: tmp_path / f"{name}.conf" for name in ("one", "four", "none")}
    write_inventory(inv["one"], [{"memory_total_mib": 16000, "memory_used_mib": 2000}])
    four = [{"memory_total_mib": 40960, "memory_used_mib": used}
            for used in (30000, 1000, 20000, 39000)]
    write_inventory(inv["four"], four)
    write_inventory(inv["none"], [{"memory_total_mib": 16000, "memory_used_mib": 10}])

    tasks = fault_tasks.install(tmp_path / "tasks")

    def env(name: str) -> dict[str, str]:
        e = fake_nvml.env({"FEDGPU_SIMULATED_GPUS": "1", "FEDGPU_TOKEN": federation.token,
                           "PYTHONUNBUFFERED": "1"})
        e["FAKE_NVML_CONFIG"] = str(inv[name])
        e["PYTHONPATH"] = f"{tasks}{os.pathsep}{e['PYTHONPATH']}"
        if name == "four":
            # A forked worker's round is over in a tenth of a second: this one trains for a
            # while, so the inventory bumped below is sampled during its round.
            e[fault_tasks.SLEEP_ENV] = "1"
        return e

    # The digits task with a hook for the sleep (tests/fixtures/fault_tasks.py).
    federation.start_server(write_job(tmp_path / "job.toml", task="faulty", rounds=2,
                                      min_nodes=3, use_gpu=True), "--heartbeat-s", "1")
    federation.start_node("one", digits_split[0], env=env("one"))
    federation.start_node("four", digits_split[1], "--gpu-index", "7", env=env("four"))
    federation.start_node("none", digits_split[2], "--gpu", "none", env=env("none"))

    # While node "four" trains, its GPU's used memory rises; the agent's sampler must see it.
    stop = threading.Event()

    def bump() -> None:
        status = tmp_path / "four.status"
        while not stop.is_set():
            try:
                state = json.loads(status.read_text())["state"]
            except (OSError, ValueError, KeyError):
                state = ""
            busy = [dict(g) for g in four]
            if state == "training":
                busy[1]["memory_used_mib"] = 9000
            write_inventory(inv["four"], busy)
            time.sleep(0.02)

    t = threading.Thread(target=bump, daemon=True)
    t.start()
    try:
        federation.wait_state(("finished", "failed"))
    finally:
        stop.set()
        t.join()

    nodes = {n["name"]: n for n in federation.query("ListNodes")["nodes"]}
    assert nodes["one"]["gpu_decision"]["gpu_uuid"] == fake_uuid(0)
    four_decision = nodes["four"]["gpu_decision"]
    # --gpu-index 7 does not exist: warned, then the GPU with the most free memory (index 1).
    assert four_decision["gpu_uuid"] == fake_uuid(1) and four_decision["gpu_index"] == 1
    assert any("7" in w for w in four_decision["warnings"])
    assert nodes["none"]["gpu_decision"]["device"] == "cpu"
    assert nodes["none"]["gpu_decision"]["mode"] == "none"
    assert len(nodes["four"]["devices"]["gpus"]) == 4
    assert nodes["four"]["devices"]["driver_version"] == "550.54.15"

    rounds = federation.query("ListRounds")["rounds"]
    assert [r["status"] for r in rounds] == ["finished", "finished"]
    for rnd in rounds:
        res = {u["node"]: u["resources"] for u in rnd["updates"]}
        assert res["one"]["nvml_used_before_mib"] == 2000 == res["one"]["nvml_used_after_mib"]
        assert res["four"]["nvml_used_peak_mib"] == 9000
        assert res["none"]["device"] == "cpu" and res["none"]["nvml_used_peak_mib"] is None
        assert res["none"]["rss_peak_mib"] > 0


def test_enforce_without_gpu_exits_at_start(fake_nvml: FakeNvml, digits_split: list[Path]
                                            ) -> None:
    args = ["-m", "fedgpu.cli.app", "node", "start", "--aggregator", "127.0.0.1:1",
            "--data", str(digits_split[0]), "--token", "t", "--gpu", "enforce"]
    r = fake_nvml.run(args, env=fake_nvml.env_without_library())
    assert r.returncode == 1
    assert "--gpu enforce" in r.stderr and "NVIDIA Container Toolkit" in r.stderr
    assert "Traceback" not in r.stderr
    fake_nvml.write([])
    r = fake_nvml.run(args)
    assert r.returncode == 1 and "--gpu enforce" in r.stderr
    fake_nvml.write([{"memory_total_mib": 16000, "memory_used_mib": 15900}])
    r = fake_nvml.run([*args, "--gpu-min-free-mib", "1000"])
    assert r.returncode == 1 and "1000" in r.stderr and "Traceback" not in r.stderr
