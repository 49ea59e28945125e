"""A 300 MiB model crosses the wire both ways with default settings (no 4 MiB limit)."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np

from fedgpu.core import codec, digests
from fedgpu.core.transport import token_metadata
from fedgpu.proto import pb, pb_grpc
from tests.fixtures.federation import Federation, write_job


def test_300_mib_model_round_trip(federation: Federation, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    weights = {f"layer{i}": rng.standard_normal(7_864_320, dtype=np.float32) for i in range(10)}
    enc = codec.encode(weights)
    assert enc.size > 300 * (1 << 20)
    init = tmp_path / "init.safetensors"
    init.write_bytes(enc.to_bytes())
    job = write_job(tmp_path / "job.toml", rounds=1, min_nodes=1, evaluate=False,
                    initial_weights=str(init))
    federation.start_server(job)
    md = token_metadata(federation.token)
    with grpc.insecure_channel(federation.address) as ch:  # default channel options
        stub = pb_grpc.FederationStub(ch)
        reg = stub.Register(pb.RegisterRequest(node_name="big", tasks=["digits"]), metadata=md)
        header = None
        asm = None
        chunks = 0
        for msg in stub.PullTask(pb.PullTaskRequest(node_id=reg.node_id, wait_s=10),
                                 metadata=md, timeout=120):
            if msg.HasField("header"):
                header = msg.header
                algo, digest = digests.of_header(header)
                assert algo is codec.WIRE_DIGEST
                asm = codec.Assembler(header.payload_size, digest, 1 << 32, algo)
            else:
                chunks += 1
                asm.add(msg.data)
        assert header is not None and header.kind == pb.TASK_KIND_TRAIN
        assert chunks == -(-enc.size // codec.DEFAULT_CHUNK_SIZE)
        received, _ = codec.decode(asm.finish())
        assert all(np.array_equal(received[k], weights[k]) for k in weights)

        update = {k: v + 1.0 for k, v in weights.items()}
        up = codec.encode(update)

        def stream():
            head = pb.UpdateHeader(
                node_id=reg.node_id, task_id=header.task_id, round=header.round,
                kind=header.kind, num_examples=10, payload_size=up.size)
            digests.stamp(head, codec.WIRE_DIGEST, up.digest)
            yield pb.UpdateChunk(header=head)
            for c in codec.iter_chunks(up):
                yield pb.UpdateChunk(data=c)

        reply = stub.PushUpdate(stream(), metadata=md, timeout=120)
        assert reply.accepted
    status = federation.wait_state(("finished",), timeout=60)
    assert status["round"] == 1
    rounds = federation.query("ListRounds")["rounds"]
    assert rounds[0]["bytes_received"] == up.size
