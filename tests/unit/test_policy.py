"""The node GPU policy on plain records: every cell of DESIGN.md's table and the selection."""

from __future__ import annotations

import json

import pytest

from fedgpu.node.nvml import GpuRecord, NvmlSnapshot
from fedgpu.node.policy import (
    Decision,
    EnforceError,
    GpuFlags,
    PolicyError,
    check_startup,
    decide,
    log_line,
    parse_gpu_flags,
    select_device,
    subprocess_env,
)


def gpu(index: int, free: int | None, *, healthy: bool = True, total: int = 40960) -> GpuRecord:
    return GpuRecord(
        index=index,
        uuid=f"GPU-{index:08x}-aaaa-bbbb-cccc-{index:012x}",
        name=f"NVIDIA Test {index}",
        memory_total_mib=None if free is None else total,
        memory_used_mib=None if free is None else total - free,
        memory_free_mib=free,
        utilization_pct=0,
        compute_capability="8.0",
        processes=(),
        healthy=healthy,
        reason="ok" if healthy else "unhealthy: uuid: GPU is lost (NVML_ERROR_GPU_IS_LOST)",
    )


def snap(*gpus: GpuRecord) -> NvmlSnapshot:
    return NvmlSnapshot(True, f"NVML sees {len(gpus)} GPUs", "550.54.15", "12.4", gpus)


NO_LIBRARY = NvmlSnapshot(
    False, "libnvidia-ml.so.1 not found: no NVIDIA driver on this host", None, None, ()
)
FOUR = snap(gpu(0, 1000), gpu(1, 30000), gpu(2, 20000), gpu(3, 30000))


def flags(mode: str = "offer", index: str | None = None, min_free: int = 0, frac=None) -> GpuFlags:
    return parse_gpu_flags(mode, index, min_free, frac)


# --- the policy table -------------------------------------------------------------------


@pytest.mark.parametrize("job_use_gpu", [True, False])
@pytest.mark.parametrize("snapshot", [FOUR, NO_LIBRARY], ids=["gpus", "no-nvml"])
def test_none_is_cpu_whatever_the_job_or_host(snapshot: NvmlSnapshot, job_use_gpu: bool) -> None:
    d = decide(snapshot, flags("none"), job_use_gpu)
    assert (d.use_gpu, d.device, d.gpu_uuid) == (False, "cpu", None)
    assert "--gpu none" in d.reason


def test_offer_and_job_asks_picks_the_gpu_with_most_free_memory() -> None:
    d = decide(FOUR, flags("offer"), job_use_gpu=True)
    assert (d.use_gpu, d.device, d.gpu_index) == (True, "cuda", 1)  # 1 and 3 tie: lower index
    assert d.gpu_uuid == FOUR.gpus[1].uuid and d.gpu_name == "NVIDIA Test 1"
    assert d.reason == "most free memory (30000 MiB) of 4 usable GPUs"


def test_offer_and_job_asks_without_nvml_falls_back_to_cpu_with_the_nvml_reason() -> None:
    d = decide(NO_LIBRARY, flags("offer"), job_use_gpu=True)
    assert (d.use_gpu, d.device) == (False, "cpu")
    assert "no usable GPU" in d.reason and "libnvidia-ml.so.1 not found" in d.reason


def test_offer_and_job_asks_with_zero_gpus_is_cpu() -> None:
    d = decide(snap(), flags("offer"), job_use_gpu=True)
    assert d.device == "cpu" and "NVML sees no GPU" in d.reason


def test_offer_and_job_does_not_ask_is_cpu_even_with_free_gpus() -> None:
    d = decide(FOUR, flags("offer"), job_use_gpu=False)
    assert (d.use_gpu, d.device) == (False, "cpu")
    assert d.reason == "job does not ask for a GPU"


@pytest.mark.parametrize("job_use_gpu", [True, False])
def test_enforce_uses_a_gpu_whatever_the_job(job_use_gpu: bool) -> None:
    d = decide(FOUR, flags("enforce"), job_use_gpu)
    assert (d.use_gpu, d.device, d.gpu_index) == (True, "cuda", 1)
    assert ("does not ask" in d.reason) is (not job_use_gpu)


def test_enforce_without_nvml_raises_naming_the_fix() -> None:
    with pytest.raises(EnforceError, match="--gpu enforce.*libnvidia-ml.so.1 not found"):
        decide(NO_LIBRARY, flags("enforce"), job_use_gpu=True)


def test_enforce_with_zero_gpus_points_at_the_container_toolkit() -> None:
    with pytest.raises(EnforceError) as err:
        decide(snap(), flags("enforce"), job_use_gpu=False)
    assert "started with --gpu enforce but NVML sees no GPU" in str(err.value)
    assert "NVIDIA Container Toolkit" in str(err.value)


def test_enforce_with_all_gpus_below_min_free_says_the_numbers() -> None:
    with pytest.raises(EnforceError) as err:
        decide(FOUR, flags("enforce", min_free=50000), job_use_gpu=True)
    message = str(err.value)
    assert "--gpu-min-free-mib 50000" in message
    assert "30000 MiB" in message and "GPU 1" in message


def test_enforce_with_all_gpus_lost_says_so() -> None:
    lost = snap(gpu(0, None, healthy=False), gpu(1, None, healthy=False))
    with pytest.raises(EnforceError, match="all 2 GPUs are unhealthy.*GPU_IS_LOST"):
        decide(lost, flags("enforce"), job_use_gpu=True)


def test_check_startup_raises_only_for_enforce() -> None:
    with pytest.raises(EnforceError):
        check_startup(NO_LIBRARY, flags("enforce"))
    check_startup(FOUR, flags("enforce"))
    for mode in ("none", "offer"):
        check_startup(NO_LIBRARY, flags(mode))
        check_startup(snap(), flags(mode))


def test_memory_fraction_travels_only_with_a_gpu_decision() -> None:
    assert decide(FOUR, flags("offer", frac=0.25), True).memory_fraction == 0.25
    assert decide(FOUR, flags("offer", frac=0.25), False).memory_fraction is None


# --- selection ----------------------------------------------------------------------------


def test_index_picks_that_gpu_even_if_another_has_more_free() -> None:
    chosen, reason, warnings = select_device(FOUR.gpus, flags(index="2"))
    assert chosen is FOUR.gpus[2]
    assert reason == "requested by --gpu-index 2" and warnings == ()


def test_full_uuid_and_unique_prefix_pick_that_gpu() -> None:
    uuid = FOUR.gpus[2].uuid
    assert select_device(FOUR.gpus, flags(index=uuid))[0] is FOUR.gpus[2]
    assert select_device(FOUR.gpus, flags(index="GPU-" + uuid[4:].upper()))[0] is FOUR.gpus[2]
    assert select_device(FOUR.gpus, flags(index="GPU-00000002"))[0] is FOUR.gpus[2]


def test_missing_index_warns_and_falls_back_to_best() -> None:
    chosen, _, warnings = select_device(FOUR.gpus, flags(index="7"))
    assert chosen is FOUR.gpus[1]
    assert len(warnings) == 1 and "--gpu-index 7: no such GPU" in warnings[0]
    assert "falling back" in warnings[0]


def test_unknown_uuid_and_ambiguous_prefix_fall_back() -> None:
    for wanted in ("GPU-deadbeef", "GPU-0000"):
        chosen, _, warnings = select_device(FOUR.gpus, flags(index=wanted))
        assert chosen is FOUR.gpus[1] and "no such GPU" in warnings[0]


def test_mig_index_falls_back_with_a_reason() -> None:
    chosen, _, warnings = select_device(FOUR.gpus, flags(index="MIG-1234-abcd"))
    assert chosen is FOUR.gpus[1] and "MIG" in warnings[0]


def test_unhealthy_requested_gpu_falls_back_and_the_warning_reaches_the_decision() -> None:
    gpus = snap(gpu(0, 5000), gpu(1, None, healthy=False))
    d = decide(gpus, flags(index="1"), job_use_gpu=True)
    assert d.gpu_index == 0
    assert "unhealthy" in d.warnings[0] and "GPU_IS_LOST" in d.warnings[0]


def test_requested_gpu_below_min_free_falls_back() -> None:
    chosen, _, warnings = select_device(FOUR.gpus, flags(index="0", min_free=2000))
    assert chosen is FOUR.gpus[1]
    assert "1000 MiB free, below --gpu-min-free-mib 2000" in warnings[0]


def test_min_free_filters_and_names_the_threshold() -> None:
    gpus = (gpu(0, 10000), gpu(1, 3000), gpu(2, 8000))
    chosen, reason, _ = select_device(gpus, flags(min_free=9000))
    assert chosen is gpus[0]
    assert reason == "only usable GPU (10000 MiB free), 3 seen, --gpu-min-free-mib 9000"
    assert select_device(gpus, flags(min_free=10001))[0] is None


def test_min_free_is_inclusive() -> None:
    assert select_device((gpu(0, 4096),), flags(min_free=4096))[0] is not None


def test_unhealthy_gpus_are_never_best() -> None:
    gpus = (gpu(0, 80000, healthy=False), gpu(1, 100))
    assert select_device(gpus, flags())[0] is gpus[1]


def test_unknown_free_memory_qualifies_only_without_a_minimum_and_ranks_last() -> None:
    unknown, small = gpu(0, None), gpu(1, 0)
    assert select_device((unknown,), flags())[0] is unknown
    assert select_device((unknown, small), flags())[0] is small
    chosen, reason, _ = select_device((unknown,), flags(min_free=1))
    assert chosen is None and "no GPU reports its free memory" in reason


# --- flags ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("always", None, 0, None), "--gpu must be one of none, offer, enforce"),
        (("offer", "first", 0, None), "--gpu-index must be a GPU index"),
        (("offer", "-1", 0, None), "--gpu-index must be a GPU index"),
        (("offer", "GPU-xyz", 0, None), "--gpu-index must be a GPU index"),
        (("offer", None, -1, None), "--gpu-min-free-mib must be >= 0"),
        (("offer", None, 0, 0.0), r"--gpu-memory-fraction must be in \(0, 1\]"),
        (("offer", None, 0, 1.5), r"--gpu-memory-fraction must be in \(0, 1\]"),
        (("offer", None, 0, -0.5), r"--gpu-memory-fraction must be in \(0, 1\]"),
    ],
)
def test_bad_flags_raise_a_one_line_policy_error(args: tuple, message: str) -> None:
    with pytest.raises(PolicyError, match=message) as err:
        parse_gpu_flags(*args)
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)


def test_good_flags_are_normalised() -> None:
    f = parse_gpu_flags(" Enforce ", " 3 ", 512, 1.0)
    assert f == GpuFlags("enforce", "3", 512, 1.0)
    uuid = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
    assert parse_gpu_flags("offer", uuid, 0, None).index == uuid
    assert parse_gpu_flags("offer", "MIG-GPU-8932f937/1/0", 0, None).index is not None


# --- handing the decision to the training subprocess --------------------------------------


def test_cpu_decision_hides_every_gpu() -> None:
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1", "FEDGPU_MEMORY_FRACTION": "0.5"}
    env = subprocess_env(decide(FOUR, flags("none"), True), base)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["FEDGPU_DEVICE"] == "cpu"
    assert "FEDGPU_MEMORY_FRACTION" not in env
    assert env["PATH"] == "/bin" and base["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_gpu_decision_passes_the_uuid_so_the_device_is_cuda0() -> None:
    d = decide(FOUR, flags("offer", index="2", frac=0.5), True)
    env = subprocess_env(d, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert env["CUDA_VISIBLE_DEVICES"] == FOUR.gpus[2].uuid
    assert env["FEDGPU_DEVICE"] == "cuda:0"
    assert float(env["FEDGPU_MEMORY_FRACTION"]) == 0.5


def test_gpu_decision_without_fraction_sets_none() -> None:
    env = subprocess_env(decide(FOUR, flags(), True), {"FEDGPU_MEMORY_FRACTION": "0.9"})
    assert "FEDGPU_MEMORY_FRACTION" not in env


def test_gpu_decision_without_uuid_is_refused() -> None:
    d = Decision("offer", True, "cuda", 0, None, "x", None, "r")
    with pytest.raises(ValueError, match="UUID"):
        subprocess_env(d, {})


# --- reporting ------------------------------------------------------------------------------


def test_decision_dict_has_stable_keys_and_round_trips_through_json() -> None:
    d = decide(snap(gpu(0, 5000), gpu(1, None, healthy=False)), flags(index="1", frac=0.5), True)
    data = json.loads(json.dumps(d.to_dict()))
    assert list(data) == [
        "mode",
        "use_gpu",
        "device",
        "gpu_index",
        "gpu_uuid",
        "gpu_name",
        "memory_fraction",
        "reason",
        "warnings",
    ]
    assert Decision.from_dict(data) == d


def test_from_dict_rejects_an_unknown_device() -> None:
    data = decide(FOUR, flags(), True).to_dict() | {"device": "tpu"}
    with pytest.raises(ValueError, match="tpu"):
        Decision.from_dict(data)


def test_log_line_is_one_structured_line_with_the_reason() -> None:
    d = decide(FOUR, flags(index="9", frac=0.5), True)
    line = log_line(d)
    assert "\n" not in line
    assert line.startswith("gpu-decision mode=offer use_gpu=true device=cuda ")
    assert f"uuid={FOUR.gpus[1].uuid} index=1 " in line
    assert 'name="NVIDIA Test 1"' in line and "memory_fraction=0.5" in line
    assert 'reason="most free memory (30000 MiB) of 4 usable GPUs"' in line
    assert "warnings=" in line and "--gpu-index 9" in line


def test_log_line_for_cpu_leaves_out_the_gpu_fields() -> None:
    line = log_line(decide(FOUR, flags(), False))
    assert line == (
        'gpu-decision mode=offer use_gpu=false device=cpu reason="job does not ask for a GPU"'
    )
