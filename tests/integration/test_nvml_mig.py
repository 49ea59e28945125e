"""MIG devices through the real pynvml, against the fake libnvidia-ml.so.1's MIG calls.

A GPU in MIG mode is listed with its MIG devices (UUID, memory, parent, GPU/compute instance
ids); those, not the GPU, are what the policy picks from, and the round's worker gets the
MIG UUID in CUDA_VISIBLE_DEVICES. Every NVML error on a MIG call is a reason, never a crash.
Each case runs in a subprocess (pynvml keeps the first library it loads).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from tests.fixtures.fake_nvml import FakeNvml, fake_mig_uuid, fake_uuid
from tests.fixtures.federation import FEDGPU, ROOT

A100 = {"name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960, "memory_used_mib": 30000}
H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "compute_capability": "9.0"}


def _host() -> list[dict[str, Any]]:
    """GPU 0: no MIG support, 10960 MiB free. GPU 1: MIG on, devices 0 and 2 (1 is a hole).
    GPU 2: MIG on, no device configured."""
    return [
        A100,
        {**H100, "mig_mode": True, "mig": [
            {"name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "memory_total_mib": 40448,
             "memory_used_mib": 448, "gpu_instance_id": 2, "compute_instance_id": 0,
             "processes": [(4242, 400)]},
            None,
            {"name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "memory_total_mib": 9856,
             "memory_used_mib": 12, "gpu_instance_id": 9, "compute_instance_id": 0},
        ]},
        {**H100, "mig_mode": True},
    ]


def _decide(fake: FakeNvml, mode: str = "offer", index: str | None = None, min_free: int = 0,
            env: dict | None = None) -> dict[str, Any]:
    code = textwrap.dedent(
        f"""
        import json, os
        from fedgpu.node import nvml, policy
        flags = policy.parse_gpu_flags({mode!r}, {index!r}, {min_free}, None)
        try:
            d = policy.decide(nvml.snapshot(), flags, True)
        except policy.EnforceError as err:
            print(json.dumps({{"error": str(err)}}))
        else:
            child = policy.subprocess_env(d, dict(os.environ))
            print(json.dumps({{"decision": d.to_dict(), "cvd": child["CUDA_VISIBLE_DEVICES"],
                               "device": child["FEDGPU_DEVICE"]}}))
        """
    )
    return json.loads(fake.python(code, env))


def test_a_gpu_in_mig_mode_lists_its_mig_devices(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_host())
    snap = fake_nvml.snapshot()
    whole, split, empty = snap["gpus"]
    assert whole["mig_mode"] is None and whole["mig_devices"] == [] and whole["mig"] is None
    assert whole["mig_reason"] == "MIG not available on this GPU or driver: Not Supported"
    assert whole["reason"] == "ok"  # no MIG is not a fault of the GPU
    assert split["mig_mode"] is True
    assert split["mig_reason"] == "MIG mode on: 2 MIG devices, trained on in its place"
    first, third = split["mig_devices"]
    assert first == {
        "index": 1,
        "uuid": fake_mig_uuid(1, 0),
        "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        "memory_total_mib": 40448,
        "memory_used_mib": 448,
        "memory_free_mib": 40000,
        "utilization_pct": None,  # NVML has none per MIG device; not asked, so no note
        "compute_capability": "9.0",
        "processes": [{"pid": 4242, "used_mib": 400}],
        "healthy": True,
        "reason": "ok",
        "mig_mode": None,
        "mig_reason": "",
        "mig_devices": [],
        "mig": {"parent_index": 1, "parent_uuid": fake_uuid(1), "mig_index": 0,
                "gpu_instance_id": 2, "compute_instance_id": 0},
    }
    assert (third["uuid"], third["memory_free_mib"], third["mig"]["mig_index"]) == (
        fake_mig_uuid(1, 2), 9844, 2)
    assert empty["mig_mode"] is True and empty["mig_devices"] == []
    assert empty["mig_reason"].startswith("MIG mode is on but no MIG device is configured")
    assert "2 in MIG mode with 2 MIG devices" in snap["reason"]


def test_the_policy_picks_a_mig_device_and_hands_over_its_uuid(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_host())
    out = _decide(fake_nvml)
    # MIG device 0 of GPU 1 (40000 MiB free) beats GPU 0 (10960); GPU 1 itself and GPU 2
    # (MIG on, nothing configured) are no candidates, though each has 81559 MiB "free".
    assert out["decision"]["gpu_uuid"] == fake_mig_uuid(1, 0)
    assert out["decision"]["gpu_index"] == 1
    assert out["cvd"] == fake_mig_uuid(1, 0) and out["device"] == "cuda:0"
    assert "MIG device 0 of GPU 1" in out["decision"]["reason"]
    assert "of 3 usable devices" in out["decision"]["reason"]


def test_gpu_index_takes_a_mig_uuid_and_refuses_a_split_gpu_by_index(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_host())
    small = fake_mig_uuid(1, 2)
    out = _decide(fake_nvml, index=small)
    assert out["cvd"] == small and out["decision"]["reason"] == f"requested by --gpu-index {small}"
    out = _decide(fake_nvml, index="1")
    assert out["cvd"] == fake_mig_uuid(1, 0)  # the best device instead
    (warning,) = out["decision"]["warnings"]
    assert "GPU 1 is in MIG mode and cannot train whole" in warning and small in warning


def test_mig_without_instances_is_the_reason_enforce_gives(fake_nvml: FakeNvml) -> None:
    fake_nvml.write([{**H100, "mig_mode": True}])
    out = _decide(fake_nvml, mode="enforce")
    assert "no device to train on" in out["error"]
    assert "nvidia-smi mig -cgi" in out["error"]


def test_min_free_applies_to_mig_devices(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_host())
    out = _decide(fake_nvml, min_free=20000)
    assert out["cvd"] == fake_mig_uuid(1, 0)
    assert "only usable device" in out["decision"]["reason"]


def test_mig_errors_are_reasons_and_the_gpu_is_used_whole(fake_nvml: FakeNvml) -> None:
    # An old driver without the MIG entry points (FUNCTION_NOT_FOUND, as pynvml reports a
    # symbol the library lacks): no MIG, the GPU trains whole, nothing crashes.
    fake_nvml.write(_host(), missing=["nvmlDeviceGetMigMode"])
    snap = fake_nvml.snapshot()
    assert [g["mig_mode"] for g in snap["gpus"]] == [None, None, None]
    assert "Function Not Found" in snap["gpus"][1]["mig_reason"]
    assert all(g["healthy"] for g in snap["gpus"])


def test_mig_devices_that_cannot_be_listed_leave_a_reason(fake_nvml: FakeNvml) -> None:
    host = _host()
    host[1]["not_supported"] = ["mig_devices"]
    fake_nvml.write(host, missing=["nvmlDeviceGetGpuInstanceId"])
    snap = fake_nvml.snapshot()
    assert snap["gpus"][1]["mig_devices"] == []
    assert "MIG devices cannot be listed: Not Supported" in snap["gpus"][1]["mig_reason"]
    # GPU 2 lists none either (none configured); so GPU 0 is the one device.
    assert _decide(fake_nvml)["cvd"] == fake_uuid(0)


def test_missing_instance_ids_are_null_not_a_failure(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_host(), missing=["nvmlDeviceGetGpuInstanceId"])
    mig = fake_nvml.snapshot()["gpus"][1]["mig_devices"][0]
    assert mig["healthy"] and mig["mig"]["gpu_instance_id"] is None
    assert mig["mig"]["compute_instance_id"] == 0


def test_a_pending_mode_change_is_reported(fake_nvml: FakeNvml) -> None:
    fake_nvml.write([{**H100, "mig_mode": False, "mig_pending": True}])
    gpu = fake_nvml.snapshot()["gpus"][0]
    assert gpu["mig_mode"] is False
    assert gpu["mig_reason"] == "MIG mode off; MIG mode turns on at the next GPU reset"


def test_cuda_visible_devices_may_name_mig_devices(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_host())
    for value in (fake_mig_uuid(1, 2), f"MIG-{fake_uuid(1)}/9/0"):
        env = fake_nvml.env({"CUDA_VISIBLE_DEVICES": value})
        snap = fake_nvml.snapshot(env)
        (gpu,) = snap["gpus"]
        assert [m["uuid"] for m in gpu["mig_devices"]] == [fake_mig_uuid(1, 2)], value
        assert _decide(fake_nvml, env=env)["cvd"] == fake_mig_uuid(1, 2)


def test_sampler_reads_mig_devices_with_and_without_mig_uuid_lookup(fake_nvml: FakeNvml) -> None:
    code = textwrap.dedent(
        f"""
        from fedgpu.node.gpu_sampler import MemorySampler
        with MemorySampler() as s:
            each = s.used_mib_each([{fake_mig_uuid(1, 0)!r}, {fake_mig_uuid(1, 2)!r},
                                    {fake_uuid(0)!r}, "MIG-ffffffff-0000-0000-0000-0"])
            with s.watch_peaks(list(each)[:3], interval_s=0.01) as watch:
                pass
            print(list(each.values()), list(watch.peaks.values()), watch.peak_mib)
        """
    )
    for lookup in (True, False):
        fake_nvml.write(_host(), mig_uuid_lookup=lookup)
        out = fake_nvml.python(code).strip()
        assert out == "[448, 12, 30000, None] [448, 12, 30000] 448", lookup


def _cli(fake: FakeNvml, *args: str) -> subprocess.CompletedProcess[str]:
    return fake.run(["-m", "fedgpu.cli.app", "devices", *args], fake.env({"COLUMNS": "250"}))


def test_devices_shows_mig_devices_under_their_gpu(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_host())
    done = _cli(fake_nvml)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    gpu_row = next(i for i, line in enumerate(lines) if fake_uuid(1) in line)
    assert "└ 1:0" in lines[gpu_row + 1] and fake_mig_uuid(1, 0) in lines[gpu_row + 1]
    assert "└ 1:2" in lines[gpu_row + 2] and "MIG 1g.10gb" in lines[gpu_row + 2]
    assert "MIG mode on: 2 MIG devices" in lines[gpu_row]
    assert f"train on MIG device of GPU 1 {fake_mig_uuid(1, 0)}" in done.stdout
    doc = json.loads(_cli(fake_nvml, "--json", "--gpu-index", fake_mig_uuid(1, 2)).stdout)
    assert doc["decision"]["gpu_uuid"] == fake_mig_uuid(1, 2)
    assert [m["uuid"] for m in doc["nvml"]["gpus"][1]["mig_devices"]] == [
        fake_mig_uuid(1, 0), fake_mig_uuid(1, 2)]


def test_choose_devices_through_nvml(fake_nvml: FakeNvml) -> None:
    # Two workers on this host: the two MIG devices and GPU 0 compete by free memory.
    fake_nvml.write(_host())
    code = textwrap.dedent(
        """
        import json
        from fedgpu.node import nvml, policy
        from fedgpu.node.device_choice import DeviceRequest, choose_devices
        devices = nvml.training_devices(nvml.snapshot().gpus)
        flags = policy.parse_gpu_flags("enforce", None, 0, None)
        two = choose_devices(devices, flags, DeviceRequest(workers=2, min_free_mib=10000))
        four = choose_devices(devices, flags, DeviceRequest(workers=4))
        print(json.dumps([two.uuids, two.refusal, four.uuids, four.refusal]))
        """
    )
    two, no_refusal, four, refusal = json.loads(fake_nvml.python(code))
    assert two == [fake_mig_uuid(1, 0), fake_uuid(0)] and no_refusal is None
    assert four == []
    assert refusal == "this site can give 3 of the 4 GPUs the job asks for: it has 3 devices"


def test_a_federation_trains_on_a_mig_device_and_measures_it(fake_nvml: FakeNvml,
                                                             tmp_path: Path) -> None:
    # Whole path: the nodes' NVML layer, the decision, the worker's environment and the
    # agent's memory sampler, with the GPU behind a MIG UUID (the worker trains on the CPU:
    # FEDGPU_SIMULATED_GPUS, there is no CUDA here).
    fake_nvml.write([{**H100, "mig_mode": True, "mig": [
        {"memory_total_mib": 9856, "memory_used_mib": 12},
        {"memory_total_mib": 40448, "memory_used_mib": 321},
    ]}])
    env = fake_nvml.env({"FEDGPU_SIMULATED_GPUS": "1", "PYTHONUNBUFFERED": "1"})
    run_dir = tmp_path / "run"
    done = subprocess.run([*FEDGPU, "run", "--nodes", "2", "--rounds", "1", "--run-dir",
                           str(run_dir), "--gpu", "offer"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (rnd,) = json.loads((run_dir / "rounds.json").read_text())["rounds"]
    assert rnd["nodes_reporting"] == 2
    big = fake_mig_uuid(0, 1)
    for update in rnd["updates"]:
        assert update["gpu_decision"]["gpu_uuid"] == big
        res = update["resources"]
        assert res["gpu_uuid"] == big
        assert res["nvml_used_before_mib"] == res["nvml_used_after_mib"] == 321
    log = (run_dir / "logs" / "node-1.log").read_text()
    assert f"device=cuda uuid={big}" in log


def test_an_nvml_call_the_library_lacks_is_function_not_found(fake_nvml: FakeNvml) -> None:
    # The fake implements only the calls the node makes; any other (here GPU instance
    # profiles, which the node never asks for) fails in pynvml as on a driver without it,
    # so a new call in node/ cannot pass these tests by accident.
    fake_nvml.write(_host())
    out = fake_nvml.python(
        "import pynvml\n"
        "pynvml.nvmlInit()\n"
        "h = pynvml.nvmlDeviceGetHandleByIndex(1)\n"
        "try:\n"
        "    pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, 0)\n"
        "except pynvml.NVMLError_FunctionNotFound:\n"
        "    print('function not found')\n"
        "mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)\n"
        "print(pynvml.nvmlDeviceIsMigDeviceHandle(mig).value,"
        " pynvml.nvmlDeviceIsMigDeviceHandle(h).value,"
        " pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)))\n"
    )
    assert out.splitlines() == ["function not found", f"1 0 {fake_uuid(1)}"]
