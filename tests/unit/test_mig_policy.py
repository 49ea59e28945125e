"""MIG devices in the records, CUDA_VISIBLE_DEVICES resolution and the GPU policy, on plain
records: a GPU in MIG mode is replaced by its MIG devices, which are picked like GPUs and
handed to the worker by MIG UUID."""

from __future__ import annotations

import json
from dataclasses import replace

from fedgpu.core.constants import GpuNeed
from fedgpu.core.job.resources import Resources
from fedgpu.node.gpu_records import (
    GpuRecord,
    MigPlacement,
    NvmlSnapshot,
    from_dict,
    to_dict,
    training_devices,
)
from fedgpu.node.gpu_visible import resolve_visible
from fedgpu.node.policy import capacity, decide, decide_for_job, parse_gpu_flags, subprocess_env


def gpu(index: int, free: int, **kw: object) -> GpuRecord:
    record = GpuRecord(
        index=index, uuid=f"GPU-{index:08x}-aaaa-bbbb-cccc-{index:012x}", name=f"Test {index}",
        memory_total_mib=81559, memory_used_mib=81559 - free, memory_free_mib=free,
        utilization_pct=0, compute_capability="9.0", processes=(), healthy=True, reason="ok",
    )
    return replace(record, **kw)  # type: ignore[arg-type]


def mig(parent: GpuRecord, j: int, free: int, total: int = 9856) -> GpuRecord:
    return replace(
        parent, uuid=f"MIG-{parent.index:08x}-{j:04x}-0000-0000-000000000000",
        name=f"{parent.name} MIG 1g.10gb", memory_total_mib=total,
        memory_used_mib=total - free, memory_free_mib=free, utilization_pct=None,
        mig=MigPlacement(parent.index, parent.uuid, j, j + 7, 0),
    )


WHOLE = gpu(0, 20000, mig_mode=False, mig_reason="MIG mode off")
_SPLIT = gpu(1, 81000)
SPLIT = replace(_SPLIT, mig_mode=True, mig_reason="MIG mode on: 2 MIG devices",
                mig_devices=(mig(_SPLIT, 0, 9000), mig(_SPLIT, 3, 30000, total=40448)))
EMPTY = gpu(2, 81559, mig_mode=True, mig_reason="MIG mode is on but no MIG device ...")
HOST = NvmlSnapshot(True, "NVML sees 3 GPUs", "550.54.15", "12.4", (WHOLE, SPLIT, EMPTY))


def test_training_devices_put_mig_devices_in_place_of_their_gpu() -> None:
    assert [d.uuid for d in training_devices(HOST.gpus)] == [
        WHOLE.uuid, SPLIT.mig_devices[0].uuid, SPLIT.mig_devices[1].uuid]


def test_records_round_trip_and_old_reports_still_read() -> None:
    doc = json.loads(json.dumps(to_dict(HOST)))
    assert from_dict(doc) == HOST
    # A node from before MIG support sends none of the MIG keys.
    for g in doc["gpus"]:
        for key in ("mig_mode", "mig_reason", "mig_devices", "mig"):
            del g[key]
    old = from_dict(doc)
    assert [g.mig_mode for g in old.gpus] == [None, None, None]
    assert training_devices(old.gpus) == old.gpus


def test_visible_devices_by_mig_uuid_prefix_and_cuda_11_0_name() -> None:
    small, big = SPLIT.mig_devices
    kept, notes = resolve_visible(HOST.gpus, small.uuid)
    assert kept == (replace(SPLIT, mig_devices=(small,)),) and notes == ()
    kept, _ = resolve_visible(HOST.gpus, f"MIG-{SPLIT.uuid}/10/0")  # GPU instance 10 = j 3 + 7
    assert kept[0].mig_devices == (big,)
    kept, notes = resolve_visible(HOST.gpus, "MIG-00000001")
    assert kept == () and "ambiguous MIG UUID prefix (2 MIG devices match)" in notes[0]


def test_a_gpu_named_whole_and_by_mig_keeps_all_its_mig_devices() -> None:
    small = SPLIT.mig_devices[0]
    kept, _ = resolve_visible(HOST.gpus, f"{small.uuid},1,{WHOLE.uuid}")
    assert kept == (SPLIT, WHOLE)


def test_decide_picks_the_mig_device_with_most_free_memory() -> None:
    d = decide(HOST, parse_gpu_flags("offer", None, 0, None), True)
    big = SPLIT.mig_devices[1]
    assert (d.gpu_uuid, d.gpu_index, d.gpu_name) == (big.uuid, 1, big.name)
    env = subprocess_env(d, {})
    assert env["CUDA_VISIBLE_DEVICES"] == big.uuid and env["FEDGPU_DEVICE"] == "cuda:0"


def test_admission_sees_mig_devices_not_the_split_gpus() -> None:
    site = capacity(HOST, parse_gpu_flags("offer", None, 0, None))
    assert [(g.index, g.uuid, g.free_mib) for g in site.gpus] == [
        (0, WHOLE.uuid, 20000), (1, SPLIT.mig_devices[0].uuid, 9000),
        (1, SPLIT.mig_devices[1].uuid, 30000)]


def test_the_job_memory_cap_is_a_fraction_of_the_mig_device() -> None:
    need = Resources(gpu=GpuNeed.REQUIRED, gpu_memory_mib=4044)
    d = decide_for_job(HOST, parse_gpu_flags("offer", None, 0, None), need)
    assert d.gpu_uuid == SPLIT.mig_devices[1].uuid
    assert d.memory_fraction == round(4044 / 40448, 6)
