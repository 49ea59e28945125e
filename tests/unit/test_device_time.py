"""GPU-hours (server/rounds/device_time.py): each update's device-seconds from the node's
report (a data-parallel round's workers summed), per site and per job, in `rounds --json`,
`job status --json` and the Prometheus counter."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.core import CounterMetricFamily

from fedgpu.proto import pb
from fedgpu.server.rounds import device_time
from fedgpu.server.rounds.records import Resources
from fedgpu.server.views.metrics import _device_seconds


def _wire(train: float, devices: list[float]) -> pb.RoundResources:
    return pb.RoundResources(device="cuda", train_seconds=train,
                             device_seconds=sum(devices), devices=[
                                 pb.DeviceUse(rank=i, device="cuda", gpu_uuid=f"GPU-{i}",
                                              nvml_used_before_mib=0, nvml_used_peak_mib=-1,
                                              nvml_used_after_mib=0, train_seconds=s)
                                 for i, s in enumerate(devices)])


def test_a_data_parallel_update_keeps_each_device_and_their_sum() -> None:
    r = Resources.from_wire(_wire(2.0, [2.0, 1.5]))
    d = r.to_dict()
    assert d["device_seconds"] == 3.5
    assert [x["gpu_uuid"] for x in d["devices"]] == ["GPU-0", "GPU-1"]
    assert d["devices"][1]["nvml_used_peak_mib"] is None  # -1 on the wire: not measured
    assert Resources.from_dict(d) == r
    # One device (or a node from before device_seconds): its training time, no devices key.
    one = Resources.from_wire(pb.RoundResources(device="cpu", train_seconds=4.25)).to_dict()
    assert one["device_seconds"] == 4.25 and "devices" not in one


def _update(node: str, res: dict) -> dict:
    return {"node": node, "node_id": f"{node}-x", "resources": res}


def test_sums_per_site_and_job_with_older_records_counting_their_training_time() -> None:
    rounds = [
        {"updates": [_update("a", {"device_seconds": 3.5, "train_seconds": 2.0}),
                     _update("b", {"train_seconds": 1.0})]},  # recorded before device_seconds
        {"updates": [_update("a", {"device_seconds": 4.0}), _update("b", {})]},
        {"updates": []},
    ]
    assert device_time.per_site(rounds) == {"a": 7.5, "b": 1.0}
    assert device_time.summary(rounds) == {"total": 8.5, "hours": round(8.5 / 3600, 4),
                                           "per_site": {"a": 7.5, "b": 1.0}}
    assert device_time.summary([]) == {"total": 0.0, "hours": 0.0, "per_site": {}}


def test_the_prometheus_counter_is_per_site_and_job() -> None:
    recs = [SimpleNamespace(updates=[
        SimpleNamespace(node="a", resources=Resources(device_seconds=3.5, train_seconds=2.0)),
        SimpleNamespace(node="b", resources=Resources(train_seconds=1.25))])] * 2
    family = _device_seconds("job1", SimpleNamespace(history=SimpleNamespace(records=recs)))
    assert isinstance(family, CounterMetricFamily) and family.name == "fedgpu_device_seconds"
    got = {(s.labels["job_id"], s.labels["site"]): s.value for s in family.samples
           if s.name == "fedgpu_device_seconds_total"}
    assert got == {("job1", "a"): 7.0, ("job1", "b"): 2.5}
