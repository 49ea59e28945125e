"""The aggregator's side of GPU-aware admission and of abandoning tasks, driven through the
real wire by scripted nodes (a real aggregator process; the nodes are the test): an
"ineligible" answer is no failure of its node and spends no retry of its round, the next
attempt samples the others, a node whose reported GPUs do not fit is never sampled and
`job status` says why, and a heartbeat naming a task the aggregator no longer waits for is
answered "abandon"."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedgpu.core import admin_client, codec, digests
from fedgpu.core.transport import token_metadata
from fedgpu.proto import pb, pb_grpc
from tests.fixtures.federation import Federation, write_job

GLOBAL = {"b": np.zeros(3, np.float32), "w": np.arange(12, dtype=np.float32).reshape(4, 3)}
GOOD = {"b": np.ones(3, np.float32), "w": np.full((4, 3), 2.0, np.float32)}


def capacity(free_mib: int, mode: str = "offer") -> pb.NodeCapacity:
    return pb.NodeCapacity(gpu_mode=mode, nvml_available=True, nvml_reason="NVML sees 1 GPU",
                           gpus=[pb.GpuInfo(index=0, uuid="GPU-0000", memory_total_mib=24000,
                                            memory_free_mib=free_mib, healthy=True)])


@dataclass
class Site:
    stub: pb_grpc.FederationStub
    md: tuple[tuple[str, str], ...]
    name: str
    node_id: str = ""

    def register(self, cap: pb.NodeCapacity) -> Site:
        reply = self.stub.Register(pb.RegisterRequest(node_name=self.name, tasks=["digits"],
                                                      capacity=cap),
                                   metadata=self.md, timeout=10)
        self.node_id = reply.node_id
        return self

    def pull(self, wait_s: int = 1) -> pb.TaskHeader | None:
        header = None
        for msg in self.stub.PullTask(pb.PullTaskRequest(node_id=self.node_id, wait_s=wait_s),
                                      metadata=self.md, timeout=60):
            if msg.HasField("header"):
                header = msg.header
        assert header is not None
        return header if header.kind == pb.TASK_KIND_TRAIN else None

    def heartbeat(self, task_id: str = "", cap: pb.NodeCapacity | None = None
                  ) -> pb.HeartbeatReply:
        req = pb.HeartbeatRequest(node_id=self.node_id, state="training", task_id=task_id)
        if cap is not None:
            req.capacity.CopyFrom(cap)
        return self.stub.Heartbeat(req, metadata=self.md, timeout=10)

    def push(self, header: pb.UpdateHeader, chunks: list[bytes] | None = None) -> pb.PushReply:
        def stream() -> Iterator[pb.UpdateChunk]:
            yield pb.UpdateChunk(header=header)
            for c in chunks or []:
                yield pb.UpdateChunk(data=c)
        return self.stub.PushUpdate(stream(), metadata=self.md, timeout=30)


@pytest.fixture
def wired(federation: Federation, tmp_path: Path) -> Iterator[tuple[Federation, Site, Site,
                                                                    Site]]:
    init = tmp_path / "init.safetensors"
    init.write_bytes(codec.encode(GLOBAL).to_bytes())
    # No retry to spare: an "ineligible" answer that cost one would fail the job. Half of the
    # two fitting nodes is sampled, so one node's answer decides an attempt.
    job = write_job(tmp_path / "job.toml", rounds=1, min_nodes=1, fraction=0.5,
                    round_deadline_s=120, evaluate=False, round_retries=0, use_gpu=None,
                    initial_weights=str(init),
                    resources={"gpu": "required", "min_gpu_free_mib": 8000})
    federation.start_server(job, "--state-dir", str(tmp_path / "state"))
    with grpc.insecure_channel(federation.address) as ch:
        stub = pb_grpc.FederationStub(ch)
        md = token_metadata(federation.token)
        a, b, c = (Site(stub, md, name) for name in ("site-a", "site-b", "site-c"))
        a.register(capacity(20000))
        b.register(capacity(20000))
        c.register(capacity(1000))
        yield federation, a, b, c


def job_doc(fed: Federation) -> dict:
    (job,) = fed.query("ListJobs")
    return fed.query("GetJob", job_id=job["job_id"])


def test_an_ineligible_answer_spends_no_retry_and_the_next_attempt_samples_the_others(
        wired: tuple[Federation, Site, Site, Site]) -> None:
    fed, a, b, c = wired
    # Which of the two fitting nodes the seeded sample picks first.
    first = second = None
    task = None
    end = time.monotonic() + 60
    while task is None and time.monotonic() < end:
        for site in (a, b):
            task = site.pull()
            if task is not None:
                first, second = site, (b if site is a else a)
                break
    assert task is not None and first is not None and second is not None
    # The node whose GPUs do not fit is never sampled, and job status says why, per site.
    doc = job_doc(fed)
    parts = {p["name"]: p for p in doc["nodes"]}
    assert parts["site-a"]["eligible"] and parts["site-b"]["eligible"]
    assert parts["site-c"]["eligible"] is False
    assert "no GPU has 8000 MiB free" in parts["site-c"]["reason"]
    assert "GPU 0 1000 MiB free" in parts["site-c"]["reason"]
    assert c.pull() is None

    # A heartbeat naming the open task is not told to abandon it; one naming another is.
    assert first.heartbeat(task.task_id).abandon is False
    assert first.heartbeat("not-a-task-of-mine").abandon is True
    assert first.heartbeat().abandon is False  # idle: nothing to abandon

    reply = first.push(pb.UpdateHeader(node_id=first.node_id, task_id=task.task_id,
                                       round=task.round, kind=task.kind, ineligible=True,
                                       ineligible_reason="GPU 0 has 2000 MiB free now"))
    assert reply.accepted and "ineligib" in reply.message
    # The attempt closes at once (the other node cannot make up for it): the task is over.
    end = time.monotonic() + 30
    while not first.heartbeat(task.task_id).abandon and time.monotonic() < end:
        time.sleep(0.1)
    assert first.heartbeat(task.task_id).abandon is True

    # The attempt closed at once (no wait for the deadline), and the next one went to the
    # other node although the round had no retry to spare.
    retry = None
    end = time.monotonic() + 30
    while retry is None and time.monotonic() < end:
        retry = second.pull()
    assert retry is not None and retry.round == task.round
    assert first.pull() is None  # its refusal holds until it reports its GPUs again
    enc = codec.encode(GOOD)
    update = pb.UpdateHeader(node_id=second.node_id, task_id=retry.task_id, round=retry.round,
                             kind=retry.kind, num_examples=5, payload_size=enc.size)
    digests.stamp(update, enc.algorithm or codec.DigestAlgo.BLAKE3, enc.digest)
    assert second.push(update, list(codec.iter_chunks(enc, 4096))).accepted

    status = fed.wait_state(("finished", "failed"), timeout=60)
    assert status["state"] == "finished", status
    rounds = fed.query("ListRounds")["rounds"]
    assert [(r["attempt"], r["status"]) for r in rounds] == [(1, "retried"), (2, "finished")]
    assert rounds[0]["ineligible"] == [{"node_id": first.node_id, "node": first.name,
                                        "reason": "GPU 0 has 2000 MiB free now"}]
    assert rounds[0]["failures"] == [] and "ineligible" not in rounds[1]
    nodes = {n["name"]: n for n in fed.query("ListNodes")["nodes"]}
    assert nodes[first.name]["rounds_failed"] == 0 and nodes[first.name]["last_error"] is None
    events = admin_client.job_logs(fed.address, fed.operator_token, doc["job_id"])
    assert any(e["source"] == "node" and e["node"] == first.name
               and "GPU 0 has 2000 MiB free now" in e["message"] for e in events), events


def test_reported_capacity_decides_and_a_bad_one_is_refused(
        wired: tuple[Federation, Site, Site, Site]) -> None:
    fed, a, b, c = wired
    # site-c's GPUs free up: its next heartbeat makes it eligible.
    assert c.heartbeat(cap=capacity(16000)).known
    parts = {p["name"]: p for p in job_doc(fed)["nodes"]}
    assert parts["site-c"]["eligible"] is True and parts["site-c"]["reason"] is None
    # A site that trains on GPUs only but has none that fits.
    c.heartbeat(cap=capacity(1000, mode="enforce"))
    reason = {p["name"]: p for p in job_doc(fed)["nodes"]}["site-c"]["reason"]
    assert reason.startswith('the job requires a GPU (gpu = "required") and no GPU has 8000')
    with pytest.raises(grpc.RpcError) as err:
        Site(a.stub, a.md, "site-d").register(capacity(1000, mode="sometimes"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "capacity refused" in (err.value.details() or "")
    with pytest.raises(grpc.RpcError) as err:
        c.heartbeat(cap=pb.NodeCapacity(gpu_mode="offer", gpu_min_free_mib=-5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
