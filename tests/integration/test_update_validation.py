"""Every class of bad update, sent through the real wire to a real aggregator.

Each is refused with a gRPC status and a message naming the problem, is counted, shows in
`fedgpu rounds --json`, and leaves the global model bit-identical: the checkpoint of the
starting model in --state-dir keeps its sha256 until the one valid update finishes the round,
and the model that round produces is exactly that update, so nothing refused leaked into it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedgpu.core import admin_client, codec
from fedgpu.core.transport import token_metadata
from fedgpu.proto import pb, pb_grpc
from tests.fixtures.federation import Federation, job_dir, write_job

GLOBAL = {"b": np.zeros(3, np.float32), "w": np.arange(12, dtype=np.float32).reshape(4, 3)}
LIMIT_MIB = 1


@dataclass
class Wire:
    fed: Federation
    state_dir: Path
    stub: pb_grpc.FederationStub
    node_id: str

    @property
    def md(self) -> tuple[tuple[str, str], ...]:
        return token_metadata(self.fed.token)

    def next_task(self) -> pb.TaskHeader:
        """The task of the round attempt now open for our node (a new one after a refusal)."""
        for _ in range(10):
            header = None
            for msg in self.stub.PullTask(pb.PullTaskRequest(node_id=self.node_id, wait_s=20),
                                          metadata=self.md, timeout=60):
                if msg.HasField("header"):
                    header = msg.header
            assert header is not None
            if header.kind == pb.TASK_KIND_TRAIN:
                return header
        raise AssertionError("no training task was offered")

    def push(self, header: pb.UpdateHeader, chunks: list[bytes]) -> grpc.RpcError | None:
        def stream() -> Iterator[pb.UpdateChunk]:
            yield pb.UpdateChunk(header=header)
            for c in chunks:
                yield pb.UpdateChunk(data=c)
        try:
            reply = self.stub.PushUpdate(stream(), metadata=self.md, timeout=30)
        except grpc.RpcError as exc:
            return exc
        assert reply.accepted
        return None

    def global_digest(self) -> str:
        model = job_dir(self.state_dir) / "global.safetensors"
        return hashlib.sha256(model.read_bytes()).hexdigest()

    def rejections(self) -> dict[str, int]:
        return self.fed.query("GetStatus")["rejections"]


def update_header(task: pb.TaskHeader, enc: codec.Encoded, **fields: object) -> pb.UpdateHeader:
    base: dict[str, object] = dict(
        node_id="", task_id=task.task_id, round=task.round, kind=task.kind, num_examples=10,
        payload_size=enc.size)
    if enc.algorithm is codec.DigestAlgo.SHA256:
        base["payload_sha256"] = enc.digest  # the contract before BLAKE3: no algorithm named
    else:
        base.update(payload_digest_algorithm=pb.DIGEST_ALGORITHM_BLAKE3
                    if enc.algorithm is codec.DigestAlgo.BLAKE3
                    else pb.DIGEST_ALGORITHM_BLAKE3_SEGMENTS, payload_digest=enc.digest)
    base.update(fields)
    return pb.UpdateHeader(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    tmp = tmp_path_factory.mktemp("validation")
    init = tmp / "init.safetensors"
    init.write_bytes(codec.encode(GLOBAL).to_bytes())
    # Every refused answer to an open task ends that attempt; plenty of retries keep one round
    # open for the whole module.
    job = write_job(tmp / "job.toml", rounds=1, min_nodes=1, round_deadline_s=120,
                    evaluate=False, round_retries=80, initial_weights=str(init))
    fed = Federation(tmp)
    try:
        fed.start_server(job, "--state-dir", str(tmp / "state"), "--max-update-mib",
                         str(LIMIT_MIB))
        with grpc.insecure_channel(fed.address) as ch:
            stub = pb_grpc.FederationStub(ch)
            reg = stub.Register(pb.RegisterRequest(node_name="probe", tasks=["digits"]),
                                metadata=token_metadata(fed.token), timeout=10)
            yield Wire(fed, tmp / "state", stub, reg.node_id)
    finally:
        fed.stop()


Case = Callable[[Wire, pb.TaskHeader], tuple[pb.UpdateHeader, list[bytes]]]


def _send(tensors: dict[str, np.ndarray], **fields: object) -> Case:
    def make(w: Wire, task: pb.TaskHeader) -> tuple[pb.UpdateHeader, list[bytes]]:
        # sha256 with no algorithm named: the wire contract before BLAKE3 is still taken.
        enc = codec.encode(tensors, digest=codec.DigestAlgo.SHA256)
        return (update_header(task, enc, **{"node_id": w.node_id, **fields}),
                list(codec.iter_chunks(enc, 4096)))
    return make


def _raw(mutate: Callable[[bytes], tuple[bytes, int, str]]) -> Case:
    def make(w: Wire, task: pb.TaskHeader) -> tuple[pb.UpdateHeader, list[bytes]]:
        good = codec.encode(GLOBAL, digest=codec.DigestAlgo.SHA256)
        sent, size, sha = mutate(good.to_bytes())
        return (update_header(task, good, node_id=w.node_id, payload_size=size,
                              payload_sha256=sha), [sent] if sent else [])
    return make


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


GOOD = {"b": np.ones(3, np.float32), "w": np.full((4, 3), 2.0, np.float32)}
NAN_W = GOOD["w"].copy()
NAN_W[1, 2] = np.nan

# (reason, case, status, words in the message, whether the refusal ends our part in the attempt)
CASES: list[tuple[str, Case, grpc.StatusCode, str, bool]] = [
    ("unknown_node", _send(GOOD, node_id="ghost-123"), grpc.StatusCode.NOT_FOUND,
     "unknown node id 'ghost-123'", False),
    ("stale_round", _send(GOOD, round=7), grpc.StatusCode.FAILED_PRECONDITION,
     "round 7 is not the current round", False),
    ("wrong_task", _send(GOOD, task_id="forged"), grpc.StatusCode.PERMISSION_DENIED,
     "task id 'forged' was not given to probe", False),
    ("names", _send({"w": GOOD["w"], "extra": GOOD["b"]}), grpc.StatusCode.INVALID_ARGUMENT,
     "tensor names differ from the global model: missing b; unexpected extra", True),
    ("shape", _send({"b": GOOD["b"], "w": GOOD["w"].reshape(3, 4)}),
     grpc.StatusCode.INVALID_ARGUMENT, "tensor 'w' has shape [3, 4], expected [4, 3]", True),
    ("dtype", _send({"b": GOOD["b"], "w": GOOD["w"].astype(np.float64)}),
     grpc.StatusCode.INVALID_ARGUMENT, "tensor 'w' has dtype F64, the global model has F32",
     True),
    ("non_finite", _send({"b": GOOD["b"], "w": NAN_W}), grpc.StatusCode.INVALID_ARGUMENT,
     "tensor 'w' contains NaN or Inf", True),
    ("digest", _send(GOOD, payload_sha256="0" * 64), grpc.StatusCode.INVALID_ARGUMENT,
     "sha256 mismatch", True),
    ("too_large", _raw(lambda b: (b, (LIMIT_MIB << 20) + 1, _sha(b))),
     grpc.StatusCode.RESOURCE_EXHAUSTED, f"exceeds the limit of {LIMIT_MIB << 20} bytes", True),
    # A stream cut short is what a broken connection looks like: refused, and the node may
    # resume it (issue 37), so its task stays open.
    ("truncated", _raw(lambda b: (b[:-9], len(b), _sha(b))), grpc.StatusCode.INVALID_ARGUMENT,
     "stream truncated", False),
    ("malformed", _raw(lambda b: (b"\x07" * 64, 64, _sha(b"\x07" * 64))),
     grpc.StatusCode.INVALID_ARGUMENT, "payload is not a valid tensor set", True),
    ("malformed", _raw(lambda b: (b + b"!", len(b), _sha(b))), grpc.StatusCode.INVALID_ARGUMENT,
     "stream sent more than the announced", True),
    ("num_examples", _send(GOOD, num_examples=0), grpc.StatusCode.INVALID_ARGUMENT,
     "num_examples must be positive", True),
    ("wrong_kind", _send(GOOD, kind=pb.TASK_KIND_EVALUATE), grpc.StatusCode.INVALID_ARGUMENT,
     "update kind does not match the task", True),
]


@pytest.mark.parametrize(("reason", "case", "code", "words", "ends_attempt"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_update_is_refused_and_changes_nothing(
        wire: Wire, reason: str, case: Case, code: grpc.StatusCode, words: str,
        ends_attempt: bool) -> None:
    task = wire.next_task()
    before_digest, before_count = wire.global_digest(), wire.rejections().get(reason, 0)
    header, chunks = case(wire, task)
    err = wire.push(header, chunks)
    assert err is not None, "a bad update was accepted"
    assert err.code() == code, err.details()
    assert words in err.details()
    if reason != "unknown_node":
        assert f"update rejected ({reason})" in err.details()
    assert wire.global_digest() == before_digest
    assert json.loads((job_dir(wire.state_dir) / "state.json").read_text())["global_round"] == 0
    assert wire.rejections().get(reason, 0) == before_count + 1
    # Whether the open task survives: refusals of forged ids keep it, bad payloads end it.
    assert (wire.next_task().task_id != task.task_id) is ends_attempt


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupted_streams_never_get_in(wire: Wire, data: st.DataObject) -> None:
    """Random chunkings with a truncation or bit flips, against the live aggregator."""
    task = wire.next_task()
    tensors = {"b": np.asarray(data.draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=3,
                                                  max_size=3)), np.float32),
               "w": np.full((4, 3), data.draw(st.floats(-10, 10, width=32)), np.float32)}
    enc = codec.encode(tensors)
    payload = bytearray(enc.to_bytes())
    if data.draw(st.booleans(), label="truncate"):
        payload = payload[: data.draw(st.integers(0, len(payload) - 1), label="keep")]
    else:
        for pos in data.draw(st.lists(st.integers(0, len(payload) * 8 - 1), min_size=1,
                                      max_size=4, unique=True), label="flips"):
            payload[pos // 8] ^= 1 << (pos % 8)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(payload)), max_size=6), label="cuts"))
    chunks = [bytes(payload[a:b]) for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)
              if b > a]
    before = wire.global_digest()
    err = wire.push(update_header(task, enc, node_id=wire.node_id), chunks)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert any(w in err.details() for w in ("blake3-segments mismatch", "stream truncated"))
    assert wire.global_digest() == before
    assert admin_client.health(wire.fed.address) == "SERVING"


def test_refusals_are_listed_and_only_the_valid_update_counts(wire: Wire) -> None:
    task = wire.next_task()
    before = wire.global_digest()
    enc = codec.encode(GOOD)
    assert wire.push(update_header(task, enc, node_id=wire.node_id),
                     list(codec.iter_chunks(enc, 4096))) is None
    wire.fed.wait_state(("finished",), timeout=60)
    assert wire.global_digest() != before
    saved, _ = codec.decode((job_dir(wire.state_dir) / "global.safetensors").read_bytes())
    for name in GOOD:  # one update, weighted mean of one: exactly it, bit for bit
        assert np.array_equal(saved[name], GOOD[name]), name

    rounds = wire.fed.query("ListRounds")["rounds"]
    assert [r["status"] for r in rounds][-1] == "finished"
    assert all(r["status"] == "retried" for r in rounds[:-1])
    listed = [x["reason"] for r in rounds for x in r["rejected"]]
    # Everything refused is listed under round 1, except the update for a round that never was.
    expected = {c[0] for c in CASES if c[0] != "stale_round"}
    assert expected <= set(listed) <= expected | {"digest", "truncated"}  # + the fuzzed ones
    status = wire.fed.query("GetStatus")
    assert status["rejections"]["stale_round"] == 1
    assert sum(status["rejections"].values()) == len(CASES) + 10


def test_duplicate_and_late_updates(federation: Federation, tmp_path: Path) -> None:
    init = tmp_path / "init.safetensors"
    init.write_bytes(codec.encode(GLOBAL).to_bytes())
    job = write_job(tmp_path / "job.toml", rounds=1, min_nodes=2, round_deadline_s=120,
                    evaluate=False, initial_weights=str(init))
    federation.start_server(job, "--state-dir", str(tmp_path / "state"))
    md = token_metadata(federation.token)
    with grpc.insecure_channel(federation.address) as ch:
        stub = pb_grpc.FederationStub(ch)
        a, b = (Wire(federation, tmp_path / "state", stub, stub.Register(
            pb.RegisterRequest(node_name=n, tasks=["digits"]), metadata=md,
            timeout=10).node_id) for n in ("a", "b"))
        ta, tb = a.next_task(), b.next_task()
        ua = {"b": np.ones(3, np.float32), "w": np.full((4, 3), 1.0, np.float32)}
        ub = {"b": np.ones(3, np.float32), "w": np.full((4, 3), 4.0, np.float32)}

        def push(w: Wire, task: pb.TaskHeader, tensors: dict[str, np.ndarray], n: int
                 ) -> grpc.RpcError | None:
            enc = codec.encode(tensors)
            return w.push(update_header(task, enc, node_id=w.node_id, num_examples=n),
                          list(codec.iter_chunks(enc, 4096)))

        before = a.global_digest()
        assert push(a, ta, ua, 10) is None
        dup = push(a, ta, {k: v * 100 for k, v in ua.items()}, 10)
        assert dup is not None and dup.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "update rejected (duplicate): a already sent its update for round 1" in (
            dup.details())
        assert a.global_digest() == before
        assert push(b, tb, ub, 30) is None
        federation.wait_state(("finished",), timeout=60)
        # The very update again (its acknowledgement lost): acknowledged, counted once.
        assert push(a, ta, ua, 10) is None
        late = push(a, ta, {k: v * 2 for k, v in ua.items()}, 10)
        assert late is not None and late.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "update rejected (late): round 1 already closed" in late.details()
    saved, _ = codec.decode((job_dir(tmp_path / "state") / "global.safetensors").read_bytes())
    # (10 * 1 + 30 * 4) / 40: the duplicate (x100) never reached the average.
    assert np.allclose(saved["w"], 3.25, rtol=0, atol=1e-6)
    rnd = federation.query("ListRounds")["rounds"][0]
    assert rnd["nodes_reporting"] == 2
    assert [x["reason"] for x in rnd["rejected"]] == ["duplicate", "late"]
    assert federation.query("GetStatus")["rejections"] == {"duplicate": 1, "late": 1}
