"""`[resources] workers` from the job file to the node's devices: parsed strictly (DP-SGD and
ring mode refused by name), carried on the wire, and turned into one device per worker by the
site's policy, or a refusal that says why (node/worker_devices.py)."""

from __future__ import annotations

import pytest

from fedgpu.core.admission_wire import resources_from_wire, resources_to_wire
from fedgpu.core.constants import GpuNeed
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Resources, parse_job
from fedgpu.node import messages
from fedgpu.node.nvml import GpuRecord, NvmlSnapshot
from fedgpu.node.policy import Ineligible, decide_for_job, parse_gpu_flags
from fedgpu.node.worker_devices import decisions_for
from fedgpu.proto import pb


def test_workers_parse_travel_and_round_trip() -> None:
    job = parse_job({"task": "d", "resources": {"workers": "all", "min_workers": 2}})
    assert job.resources.workers == "all" and job.resources.min_workers == 2
    assert parse_job(job.to_dict()) == job
    assert parse_job({"task": "d"}).resources.workers == 1
    for r in (job.resources, Resources(workers=4), Resources(workers=3, min_workers=1)):
        assert resources_from_wire(pb.TaskHeader(resources=resources_to_wire(r))) == r


@pytest.mark.parametrize("raw, message", [
    ({"resources": {"workers": 0}}, "'resources.workers' must be a whole number from 1"),
    ({"resources": {"workers": True}}, "'resources.workers' must be"),
    ({"resources": {"workers": "many"}}, "'resources.workers' must be"),
    ({"resources": {"workers": 2, "min_workers": 3}}, "min_workers = 3 is more than workers"),
    ({"resources": {"min_workers": 0}}, "'resources.min_workers'"),
    ({"resources": {"workers": 2}, "hyperparameters": {"dp_sgd": True}},
     r"workers > 1 with DP-SGD \(hyperparameter dp_sgd\) is not supported"),
    ({"resources": {"workers": "all"}, "mode": "ring", "min_nodes": 2},
     "workers > 1 with mode = \"ring\" is not supported"),
])
def test_bad_workers_are_refused_by_name(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_job({"task": "digits", **raw}, "job.toml")


def record(index: int, free: int) -> GpuRecord:
    return GpuRecord(index, f"GPU-{index:04d}", "Test", 16000, 16000 - free, free, 0, "9.0", (),
                     True, "ok")


FOUR = NvmlSnapshot(True, "NVML sees 4 GPUs", "550", "12.4",
                    (record(0, 3000), record(1, 12000), record(2, 9000), record(3, 14000)))


def _devices(mode: str, need: Resources, snap: NvmlSnapshot = FOUR) -> list[str | None]:
    flags = parse_gpu_flags(mode, None, 4000, None)
    decisions = decisions_for(snap, flags, need, decide_for_job(snap, flags, need))
    return [d.gpu_uuid if d.device == "cuda" else None for d in decisions]


def test_n_devices_by_free_memory_and_all_means_every_usable_one() -> None:
    assert _devices("offer", Resources(workers=2)) == ["GPU-0003", "GPU-0001"]
    # GPU 0 has 3000 MiB free, under the site's 4000.
    assert _devices("enforce", Resources(workers="all")) == ["GPU-0003", "GPU-0001", "GPU-0002"]
    assert _devices("offer", Resources(workers=1)) == ["GPU-0003"]


def test_a_site_that_cannot_give_n_says_why_and_offer_falls_back_only_to_min_workers() -> None:
    with pytest.raises(Ineligible, match=r"can give 3 of the 4 GPUs.*GPU 0.* 3000 MiB free"):
        _devices("enforce", Resources(workers=4, min_workers=2))
    with pytest.raises(Ineligible, match="accepts no fewer than 4"):
        _devices("offer", Resources(workers=4, min_workers=4))
    assert len(_devices("offer", Resources(workers=4, min_workers=2))) == 3


def test_on_the_cpu_the_workers_share_it() -> None:
    assert _devices("none", Resources(workers=2)) == [None, None]
    assert _devices("offer", Resources(GpuNeed.NONE, workers=3)) == [None, None, None]
    assert _devices("none", Resources(workers="all")) == [None]


def test_each_device_is_in_the_update_and_device_seconds_sum_the_workers() -> None:
    used = {"device": "cuda", "gpu_uuid": "GPU-0003", "train_seconds": 2.0,
            "device_seconds": 3.5, "devices": [
                {"rank": 0, "device": "cuda", "gpu_uuid": "GPU-0003", "nvml_used_before_mib": 1,
                 "nvml_used_peak_mib": 900, "nvml_used_after_mib": 1, "train_seconds": 2.0},
                {"rank": 1, "device": "cuda", "gpu_uuid": "GPU-0001", "nvml_used_before_mib": 0,
                 "nvml_used_peak_mib": None, "nvml_used_after_mib": 0, "train_seconds": 1.5}]}
    r = messages.resources(used)
    assert r.device_seconds == 3.5 and [d.gpu_uuid for d in r.devices] == ["GPU-0003", "GPU-0001"]
    assert r.devices[0].nvml_used_peak_mib == 900 and r.devices[1].nvml_used_peak_mib == -1
    # One device: its own training time is the round's device time.
    assert messages.resources({"device": "cpu", "train_seconds": 2.5}).device_seconds == 2.5
