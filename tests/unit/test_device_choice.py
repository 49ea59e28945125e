"""Choosing N devices for one round (node/device_choice.py) on plain records: by free memory,
fewer only under offer and only down to the job's min_workers, refusals with the figures.
(Through the fake NVML: tests/integration/test_nvml_mig.py.)"""

from __future__ import annotations

import pytest

from fedgpu.node.device_choice import DeviceChoice, DeviceRequest, choose_devices
from fedgpu.node.gpu_records import GpuRecord, MigPlacement
from fedgpu.node.policy import GpuFlags, parse_gpu_flags, select_device


def gpu(index: int, free: int | None, *, healthy: bool = True) -> GpuRecord:
    return GpuRecord(
        index=index, uuid=f"GPU-{index:08x}-aaaa-bbbb-cccc-{index:012x}", name=f"Test {index}",
        memory_total_mib=40960, memory_used_mib=None if free is None else 40960 - free,
        memory_free_mib=free, utilization_pct=0, compute_capability="8.0", processes=(),
        healthy=healthy, reason="ok" if healthy else "unhealthy: uuid: GPU is lost",
    )


def mig(parent: int, j: int, free: int) -> GpuRecord:
    placement = MigPlacement(parent, gpu(parent, 0).uuid, j, j + 1, 0)
    return GpuRecord(
        index=parent, uuid=f"MIG-{parent:08x}-{j:04x}-0000-0000-000000000000",
        name="Test MIG 1g.10gb", memory_total_mib=9856, memory_used_mib=9856 - free,
        memory_free_mib=free, utilization_pct=None, compute_capability="9.0", processes=(),
        healthy=True, reason="ok", mig=placement,
    )


def flags(mode: str = "offer", index: str | None = None, min_free: int = 0) -> GpuFlags:
    return parse_gpu_flags(mode, index, min_free, None)


def indices(choice: DeviceChoice) -> list[int]:
    return [d.index for d in choice.devices]


HOST = (gpu(0, 10000), gpu(1, 800), gpu(2, 30000), gpu(3, 20000))


@pytest.mark.parametrize("mode", ["offer", "enforce"])
def test_n_devices_by_free_memory(mode: str) -> None:
    choice = choose_devices(HOST, flags(mode), DeviceRequest(workers=3))
    assert choice.granted and indices(choice) == [2, 3, 0]
    assert choice.uuids == tuple(HOST[i].uuid for i in (2, 3, 0))
    assert choice.reason.startswith("3 of 4 devices by free memory: GPU 2")


def test_the_refusal_names_the_device_that_falls_short() -> None:
    choice = choose_devices(HOST, flags("enforce"), DeviceRequest(workers=4, min_free_mib=4096))
    assert not choice.granted and choice.devices == ()
    assert choice.refusal == (
        f"this site can give 3 of the 4 GPUs the job asks for: GPU 1 ({HOST[1].uuid}) has "
        "800 MiB free, needs 4096"
    )


def test_offer_falls_back_to_min_workers_and_no_further() -> None:
    need = DeviceRequest(workers=4, min_workers=2, min_free_mib=15000)
    choice = choose_devices(HOST, flags("offer"), need)
    assert choice.granted and indices(choice) == [2, 3]
    assert choice.reason.startswith("2 of the 4 GPUs the job asks for (it accepts 2)")
    need = DeviceRequest(workers=4, min_workers=3, min_free_mib=15000)
    choice = choose_devices(HOST, flags("offer"), need)
    assert not choice.granted
    assert choice.refusal is not None and choice.refusal.endswith("no fewer than 3)")
    assert "GPU 0" in choice.refusal and "10000 MiB free, needs 15000" in choice.refusal


def test_enforce_never_gives_fewer() -> None:
    need = DeviceRequest(workers=4, min_workers=1, min_free_mib=15000)
    choice = choose_devices(HOST, flags("enforce"), need)
    assert not choice.granted
    assert choice.refusal is not None and "only with --gpu offer" in choice.refusal


def test_site_minimum_and_job_minimum_take_the_larger() -> None:
    choice = choose_devices(HOST, flags("enforce", min_free=15000), DeviceRequest(workers=2))
    assert indices(choice) == [2, 3]
    choice = choose_devices(HOST, flags("enforce", min_free=25000), DeviceRequest(workers=2))
    assert choice.refusal is not None and "needs 25000" in choice.refusal


def test_all_takes_every_usable_device_and_says_which_were_left() -> None:
    sick = (*HOST, gpu(4, 50000, healthy=False))
    choice = choose_devices(sick, flags("offer", min_free=1000), DeviceRequest(workers="all"))
    assert indices(choice) == [2, 3, 0]
    assert "GPU 1" in choice.reason and "GPU 4" in choice.reason and "unhealthy" in choice.reason
    nothing = choose_devices(HOST, flags("enforce", min_free=99999), DeviceRequest("all"))
    assert not nothing.granted


def test_offer_without_any_usable_gpu_trains_on_cpu() -> None:
    choice = choose_devices(HOST, flags("offer", min_free=99999), DeviceRequest(workers=2))
    assert choice.granted and choice.devices == ()
    assert choice.reason.startswith("no usable GPU, training on CPU")


@pytest.mark.parametrize(("mode", "use_gpu"), [("none", True), ("none", False), ("offer", False)])
def test_no_gpu_modes_give_the_cpu(mode: str, use_gpu: bool) -> None:
    choice = choose_devices(HOST, flags(mode), DeviceRequest(workers=2), job_use_gpu=use_gpu)
    assert choice.granted and choice.devices == ()


def test_gpu_index_goes_first_and_a_bad_one_warns() -> None:
    choice = choose_devices(HOST, flags("offer", index="0"), DeviceRequest(workers=2))
    assert indices(choice) == [0, 2] and choice.warnings == ()
    choice = choose_devices(HOST, flags("offer", index="1", min_free=1000), DeviceRequest(2))
    assert indices(choice) == [2, 3] and "not usable" in choice.warnings[0]


def test_allowed_list_restricts_and_a_gpu_uuid_allows_its_mig_devices() -> None:
    host = (gpu(0, 10000), mig(1, 0, 9000), mig(1, 1, 5000), gpu(2, 30000))
    allowed = [host[0].uuid, gpu(1, 0).uuid.upper()]
    choice = choose_devices(host, flags("enforce"), DeviceRequest(workers=3), allowed=allowed)
    assert [d.uuid for d in choice.devices] == [host[0].uuid, host[1].uuid, host[2].uuid]
    refused = choose_devices(host, flags("enforce"), DeviceRequest(workers=4), allowed=allowed)
    assert refused.refusal is not None and "1 not on the site's allowed list" in refused.refusal


def test_mig_devices_are_chosen_like_gpus() -> None:
    host = (gpu(0, 7000), mig(1, 0, 9000), mig(1, 1, 5000))
    choice = choose_devices(host, flags("offer"), DeviceRequest(workers=2))
    assert [d.uuid for d in choice.devices] == [host[1].uuid, host[0].uuid]
    assert "MIG device 0 of GPU 1" in choice.reason


@pytest.mark.parametrize("min_free", [0, 5000, 25000, 99999])
@pytest.mark.parametrize("index", [None, "3", "1", "9"])
def test_one_worker_picks_what_one_device_policy_picks(min_free: int, index: str | None) -> None:
    f = flags("offer", index=index, min_free=min_free)
    chosen, _, _ = select_device(HOST, f)
    choice = choose_devices(HOST, f, DeviceRequest(workers=1))
    assert choice.devices == (() if chosen is None else (chosen,))


@pytest.mark.parametrize(
    "kwargs",
    [{"workers": 0}, {"workers": "some"}, {"workers": True}, {"workers": 2, "min_workers": 3},
     {"workers": 2, "min_workers": 0}, {"workers": 5000}, {"min_free_mib": -1}],
)
def test_bad_requests_are_refused_at_construction(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DeviceRequest(**kwargs)
