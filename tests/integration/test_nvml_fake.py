"""The NVML layer and the GPU policy through the real pynvml, against the fake libnvidia-ml.so.1.

Each case runs in a subprocess: pynvml keeps the first NVML library it loads for the life
of the process, so only a fresh process can see a different library or none at all.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from typing import Any

import pytest

from tests.fixtures.fake_nvml import FakeNvml, fake_uuid

A100 = {"name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960, "compute_capability": "8.0"}
H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "compute_capability": "9.0"}


def _fleet(n: int) -> list[dict[str, Any]]:
    # Different models and loads so a mix-up of index, UUID or memory shows.
    return [
        {**(H100 if i % 2 else A100), "memory_used_mib": 1000 * (i + 1), "utilization_pct": 10 * i}
        for i in range(n)
    ]


def _decide(fake: FakeNvml, mode: str, use_gpu: bool = True, env: dict | None = None, **kw: Any):
    code = textwrap.dedent(
        f"""
        import json, os
        from fedgpu.node import nvml, policy
        flags = policy.parse_gpu_flags({mode!r}, {kw.get("index")!r}, {kw.get("min_free", 0)},
                                       {kw.get("fraction")!r})
        try:
            d = policy.decide(nvml.snapshot(), flags, {use_gpu!r})
        except policy.EnforceError as err:
            print(json.dumps({{"error": str(err)}}))
        else:
            child = policy.subprocess_env(d, dict(os.environ))
            print(json.dumps({{"decision": d.to_dict(), "log": policy.log_line(d),
                               "cvd": child["CUDA_VISIBLE_DEVICES"]}}))
        """
    )
    return json.loads(fake.python(code, env))


# --- host states -----------------------------------------------------------------------------


def test_no_library_is_unavailable_with_the_toolkit_hint(fake_nvml: FakeNvml) -> None:
    env = fake_nvml.env_without_library()
    probe = "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"
    if fake_nvml.run(["-c", probe], env).returncode == 0:
        pytest.skip("this host has a real libnvidia-ml.so.1, so 'no library' cannot be staged")
    snap = fake_nvml.snapshot(env)
    assert snap["available"] is False and snap["gpus"] == []
    assert snap["reason"].startswith("libnvidia-ml.so.1 not found")
    assert "NVIDIA Container Toolkit" in snap["reason"]


@pytest.mark.parametrize(
    ("init_error", "expected"),
    [
        ("driver_not_loaded", "NVIDIA driver is not loaded (NVML_ERROR_DRIVER_NOT_LOADED)"),
        ("no_permission", "no permission to open the NVIDIA devices (NVML_ERROR_NO_PERMISSION)"),
        ("lib_rm_version_mismatch", "reboot the host"),
        ("unknown", "NVML initialisation failed: Unknown Error (NVML_ERROR_UNKNOWN)"),
    ],
)
def test_init_errors_are_reasons_not_crashes(
    fake_nvml: FakeNvml, init_error: str, expected: str
) -> None:
    fake_nvml.write(_fleet(2), init_error=init_error)
    snap = fake_nvml.snapshot()
    assert snap["available"] is False and snap["gpus"] == []
    assert expected in snap["reason"]


def test_zero_gpus_is_available_but_empty(fake_nvml: FakeNvml) -> None:
    fake_nvml.write([])
    snap = fake_nvml.snapshot()
    assert snap["available"] is True and snap["gpus"] == []
    assert snap["reason"] == "NVML sees 0 GPUs"


@pytest.mark.parametrize("count", [1, 4, 8])
def test_inventory_is_read_field_by_field(fake_nvml: FakeNvml, count: int) -> None:
    fleet = _fleet(count)
    fleet[0]["processes"] = [(4242, 700), (17, None)]
    fake_nvml.write(fleet, driver="555.42.06", cuda=12050)
    snap = fake_nvml.snapshot()
    assert snap["available"] is True
    assert (snap["driver_version"], snap["cuda_driver_version"]) == ("555.42.06", "12.5")
    assert len(snap["gpus"]) == count
    for i, (got, want) in enumerate(zip(snap["gpus"], fleet, strict=True)):
        assert got["index"] == i and got["uuid"] == fake_uuid(i)
        assert got["name"] == want["name"]
        assert got["memory_total_mib"] == want["memory_total_mib"]
        assert got["memory_used_mib"] == 1000 * (i + 1)
        assert got["memory_free_mib"] == want["memory_total_mib"] - 1000 * (i + 1)
        assert got["utilization_pct"] == 10 * i
        assert got["compute_capability"] == want["compute_capability"]
        assert (got["healthy"], got["reason"]) == (True, "ok")
    # NVML's "not available" per-process memory becomes None; records are sorted by pid.
    assert snap["gpus"][0]["processes"] == [
        {"pid": 17, "used_mib": None},
        {"pid": 4242, "used_mib": 700},
    ]


def test_snapshot_shuts_nvml_down_again(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_fleet(1))
    out = fake_nvml.python(
        "import pynvml, fedgpu.node.nvml as n\n"
        "assert n.snapshot().available\n"
        "try:\n    pynvml.nvmlDeviceGetCount()\n"
        "except pynvml.NVMLError_Uninitialized:\n    print('shut down')\n"
    )
    assert out.strip() == "shut down"


@pytest.mark.parametrize(
    ("field", "nulls"),
    [
        ("memory", ["memory_total_mib", "memory_used_mib", "memory_free_mib"]),
        ("utilization", ["utilization_pct"]),
        ("compute_capability", ["compute_capability"]),
    ],
)
def test_not_supported_field_becomes_none_and_the_gpu_stays_healthy(
    fake_nvml: FakeNvml, field: str, nulls: list[str]
) -> None:
    fleet = _fleet(2)
    fleet[1]["not_supported"] = [field]
    fake_nvml.write(fleet)
    good, odd = fake_nvml.snapshot()["gpus"]
    assert odd["healthy"] is True and "Not Supported" in odd["reason"]
    for key in nulls:
        assert odd[key] is None and good[key] is not None


def test_memory_falls_back_to_v1_on_drivers_without_v2(fake_nvml: FakeNvml) -> None:
    fleet = [{**A100, "memory_used_mib": 1000, "memory_reserved_mib": 500}]
    fake_nvml.write(fleet)
    assert fake_nvml.snapshot()["gpus"][0]["memory_used_mib"] == 1000
    fake_nvml.write(fleet, missing=["nvmlDeviceGetMemoryInfo_v2"])
    gpu = fake_nvml.snapshot()["gpus"][0]
    # v1 folds the driver's reservation into "used"; free is the same either way.
    assert (gpu["memory_used_mib"], gpu["memory_free_mib"]) == (1500, 40960 - 1500)


def test_lost_gpu_is_unhealthy_and_the_others_are_still_read(fake_nvml: FakeNvml) -> None:
    fleet = _fleet(4)
    fleet[1]["lost"] = True
    fleet[2]["handle_error"] = "unknown"
    fake_nvml.write(fleet)
    snap = fake_nvml.snapshot()
    lost, broken = snap["gpus"][1], snap["gpus"][2]
    assert lost["healthy"] is False and "NVML_ERROR_GPU_IS_LOST" in lost["reason"]
    assert "reset" in lost["reason"] and lost["memory_free_mib"] is None
    assert broken["healthy"] is False and "NVML_ERROR_UNKNOWN" in broken["reason"]
    assert [g["healthy"] for g in snap["gpus"]] == [True, False, False, True]
    assert snap["gpus"][3]["memory_used_mib"] == 4000
    assert "2 unhealthy" in snap["reason"]


def test_missing_pynvml_is_a_reason(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_fleet(1))
    out = fake_nvml.python(
        "import sys; sys.modules['pynvml'] = None\n"
        "import fedgpu.node.nvml as n; s = n.snapshot(); print(s.available, s.reason)"
    )
    assert out.startswith("False nvidia-ml-py is not installed")


# --- CUDA_VISIBLE_DEVICES ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "indices"),
    [
        ("2,0", [2, 0]),
        ("", []),
        ("1,9,2", [1]),  # CUDA ignores everything after an entry it cannot resolve
        (f"{fake_uuid(3)},{fake_uuid(1)}", [3, 1]),
        ("GPU-00000002", [2]),
        ("00000001-f00d", [1]),
    ],
)
def test_cuda_visible_devices_limits_the_gpus(
    fake_nvml: FakeNvml, value: str, indices: list[int]
) -> None:
    fake_nvml.write(_fleet(4))
    snap = fake_nvml.snapshot(fake_nvml.env({"CUDA_VISIBLE_DEVICES": value}))
    assert [g["index"] for g in snap["gpus"]] == indices
    assert f"CUDA_VISIBLE_DEVICES={value!r} leaves {len(indices)}" in snap["reason"]


def test_a_mig_entry_naming_no_mig_device_ends_the_list_as_in_cuda(fake_nvml: FakeNvml) -> None:
    # No GPU is in MIG mode, so the MIG entry resolves to nothing: CUDA stops there.
    # (MIG entries that do resolve: tests/integration/test_nvml_mig.py.)
    fake_nvml.write(_fleet(2))
    value = f"MIG-2a3b4c5d-0000-0000-0000-000000000000,{fake_uuid(1)}"
    snap = fake_nvml.snapshot(fake_nvml.env({"CUDA_VISIBLE_DEVICES": value}))
    assert snap["gpus"] == []
    assert "MIG-2a3b4c5d" in snap["reason"] and "later entries ignored" in snap["reason"]


def test_decision_respects_visible_devices_and_hands_over_the_uuid(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_fleet(4))  # GPU 0 has the most free memory of the host
    env = fake_nvml.env({"CUDA_VISIBLE_DEVICES": "2,3"})
    out = _decide(fake_nvml, "offer", env=env)
    assert out["decision"]["gpu_index"] == 3  # H100: more free than GPU 2 (A100)
    assert out["cvd"] == fake_uuid(3)
    assert f"uuid={fake_uuid(3)} index=3" in out["log"]


# --- policy end to end ------------------------------------------------------------------------


def test_offer_picks_the_most_free_gpu_and_gives_its_uuid(fake_nvml: FakeNvml) -> None:
    fleet = _fleet(8)
    fleet[5]["memory_used_mib"] = 10  # the H100 with the most free memory
    fake_nvml.write(fleet)
    out = _decide(fake_nvml, "offer", fraction=0.5)
    d = out["decision"]
    assert (d["device"], d["gpu_index"], d["gpu_uuid"]) == ("cuda", 5, fake_uuid(5))
    assert d["memory_fraction"] == 0.5 and out["cvd"] == fake_uuid(5)
    assert d["reason"] == "most free memory (81549 MiB) of 8 usable GPUs"


def test_requested_lost_gpu_falls_back_with_a_warning(fake_nvml: FakeNvml) -> None:
    fleet = _fleet(4)
    fleet[3]["lost"] = True
    fake_nvml.write(fleet)
    d = _decide(fake_nvml, "offer", index="3")["decision"]
    assert d["gpu_index"] == 1 and "GPU_IS_LOST" in d["warnings"][0]


def test_enforce_without_gpus_explains(fake_nvml: FakeNvml) -> None:
    fake_nvml.write([])
    out = _decide(fake_nvml, "enforce", use_gpu=False)
    assert out["error"].startswith("started with --gpu enforce but NVML sees no GPU")
    fake_nvml.write([], init_error="driver_not_loaded")
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in _decide(fake_nvml, "enforce")["error"]
    fake_nvml.write(_fleet(2))
    error = _decide(fake_nvml, "enforce", min_free=90000)["error"]
    assert "--gpu-min-free-mib 90000" in error and "79559 MiB" in error


def test_offer_with_driver_not_loaded_trains_on_cpu(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_fleet(2), init_error="driver_not_loaded")
    out = _decide(fake_nvml, "offer")
    assert out["decision"]["device"] == "cpu" and out["cvd"] == ""
    assert "NVML unavailable" in out["decision"]["reason"]


# --- fedgpu devices --json -------------------------------------------------------------------


def _cli(fake: FakeNvml, *args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return fake.run(["-m", "fedgpu.cli.app", "devices", *args], env)


class TestDevicesCli:
    def test_json_is_one_document_with_the_documented_keys(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.write(_fleet(4))
        done = _cli(fake_nvml, "--json", "--gpu-index", "2", "--gpu-memory-fraction", "0.5")
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)  # fails on anything but exactly one JSON document
        assert list(doc) == ["nvml", "decision", "error"]
        assert doc["error"] is None
        assert list(doc["nvml"]) == [
            "available",
            "reason",
            "driver_version",
            "cuda_driver_version",
            "gpus",
        ]
        assert list(doc["nvml"]["gpus"][0]) == [
            "index",
            "uuid",
            "name",
            "memory_total_mib",
            "memory_used_mib",
            "memory_free_mib",
            "utilization_pct",
            "compute_capability",
            "processes",
            "healthy",
            "reason",
            "mig_mode",
            "mig_reason",
            "mig_devices",
            "mig",
        ]
        assert len(doc["nvml"]["gpus"]) == 4
        decision = doc["decision"]
        assert (decision["gpu_index"], decision["gpu_uuid"]) == (2, fake_uuid(2))
        assert decision["memory_fraction"] == 0.5
        assert decision["reason"] == "requested by --gpu-index 2"

    def test_enforce_failure_exits_1_and_still_prints_json(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.write([])
        done = _cli(fake_nvml, "--json", "--gpu", "enforce")
        assert done.returncode == 1
        doc = json.loads(done.stdout)
        assert doc["decision"] is None
        assert doc["error"].startswith("started with --gpu enforce but NVML sees no GPU")
        assert done.stderr == f"error: {doc['error']}\n"

    def test_no_use_gpu_reports_cpu(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.write(_fleet(1))
        doc = json.loads(_cli(fake_nvml, "--json", "--no-use-gpu").stdout)
        assert doc["decision"]["device"] == "cpu"
        assert doc["decision"]["reason"] == "job does not ask for a GPU"

    @pytest.mark.parametrize(
        "args",
        [
            ["--gpu", "always"],
            ["--gpu-index", "first"],
            ["--gpu-memory-fraction", "1.5"],
            ["--gpu-min-free-mib", "-5"],
        ],
    )
    def test_bad_flags_exit_2_with_one_line(self, fake_nvml: FakeNvml, args: list[str]) -> None:
        fake_nvml.write(_fleet(1))
        done = _cli(fake_nvml, "--json", *args)
        assert done.returncode == 2
        assert done.stdout == ""
        assert done.stderr.startswith("error: --gpu") and done.stderr.count("\n") == 1

    def test_table_shows_gpus_and_the_decision(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.write(_fleet(2))
        done = _cli(fake_nvml, env=fake_nvml.env({"COLUMNS": "250"}))
        assert done.returncode == 0, done.stderr
        assert fake_uuid(1) in done.stdout and "NVIDIA H100 80GB HBM3" in done.stdout
        assert "Decision (--gpu offer): train on GPU 1" in done.stdout
        assert "most free memory" in done.stdout

    def test_without_nvml_the_table_says_why(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.write([], init_error="no_permission")
        done = _cli(fake_nvml, env=fake_nvml.env({"COLUMNS": "250"}))
        assert done.returncode == 0, done.stderr
        assert "NVML unavailable" in done.stdout and "train on CPU" in done.stdout
