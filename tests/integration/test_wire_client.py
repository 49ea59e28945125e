"""node/wire_client.py, the one client of the Federation wire, against a real aggregator: the
agent's blocking facade and `fedgpu sim`'s asynchronous use are the same code, so these
properties hold for both."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.node.client import AggregatorClient, ClientClosed
from fedgpu.node.pulled import PayloadTooLarge
from fedgpu.node.wire_client import WireClient
from fedgpu.proto import pb
from tests.fixtures.federation import Federation, write_job

WEIGHTS = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.zeros(3, np.float32)}


def _request(name: str) -> pb.RegisterRequest:
    return pb.RegisterRequest(node_name=name, tasks=["digits"])


def test_closing_the_agents_client_ends_its_long_poll_at_once(federation: Federation) -> None:
    federation.start_server(None)
    client = AggregatorClient(federation.address, federation.token)
    node_id = client.register(_request("site-a")).node_id
    outcome: list[BaseException | tuple[pb.TaskHeader, object]] = []

    def poll() -> None:
        try:
            outcome.append(client.pull(node_id, wait_s=30, max_bytes=1 << 20))
        except BaseException as exc:  # noqa: BLE001 - the test inspects what ended the poll
            outcome.append(exc)

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(1.0)  # the poll is held open by the aggregator (no job)
    assert t.is_alive()
    started = time.monotonic()
    client.close()
    t.join(timeout=10)
    assert not t.is_alive() and time.monotonic() - started < 5
    assert len(outcome) == 1 and isinstance(outcome[0], ClientClosed), outcome


def test_the_async_client_takes_a_task_and_sends_both_payload_kinds(
        federation: Federation, tmp_path: Path) -> None:
    init = tmp_path / "init.safetensors"
    init.write_bytes(b"".join(bytes(s) for s in codec.encode(WEIGHTS).segments))
    job = write_job(tmp_path / "job.toml", min_nodes=2, rounds=1, evaluate=False,
                    initial_weights=str(init))
    federation.start_server(job, "--bulk-port", "0")  # both payload kinds over gRPC here

    async def site(name: str, from_file: bool) -> tuple[str, bool]:
        wire = WireClient(federation.address, federation.token)
        try:
            node_id = (await wire.register(_request(name))).node_id
            for _ in range(30):
                pulled = await wire.pull(node_id, 10, 1 << 20)
                if pulled.header.kind == pb.TASK_KIND_TRAIN:
                    break
            else:
                raise AssertionError("no training task")
            assert pulled.payload is not None
            tensors, _ = codec.decode(pulled.payload)
            assert np.array_equal(tensors["w"], WEIGHTS["w"])
            new = {k: v + 1 for k, v in tensors.items()}
            header = pb.UpdateHeader(node_id=node_id, task_id=pulled.header.task_id,
                                     round=pulled.header.round, kind=pulled.header.kind,
                                     num_examples=10)
            source: Path | codec.Encoded = codec.encode(new)
            if from_file:
                path = tmp_path / f"{name}.safetensors"
                path.write_bytes(b"".join(bytes(s) for s in source.segments))
                source = path
            reply, transport = await wire.push(header, source)
            return transport, reply.accepted
        finally:
            await wire.close()

    async def both() -> list[tuple[str, bool]]:
        return list(await asyncio.gather(site("a", False), site("b", True)))

    results = asyncio.run(both())
    assert results == [("grpc", True), ("grpc", True)]
    federation.wait_state(("finished",), timeout=60)


def test_a_task_over_the_nodes_limit_is_refused_before_it_is_read(
        federation: Federation, tmp_path: Path) -> None:
    init = tmp_path / "init.safetensors"
    init.write_bytes(b"".join(bytes(s) for s in codec.encode(WEIGHTS).segments))
    job = write_job(tmp_path / "job.toml", min_nodes=1, rounds=1, initial_weights=str(init))
    federation.start_server(job)

    async def go() -> PayloadTooLarge:
        wire = WireClient(federation.address, federation.token)
        try:
            node_id = (await wire.register(_request("small"))).node_id
            with pytest.raises(PayloadTooLarge) as info:
                for _ in range(30):
                    await wire.pull(node_id, 10, 16)
            return info.value
        finally:
            await wire.close()

    exc = asyncio.run(go())
    assert exc.header is not None and exc.header.payload_size > 16
