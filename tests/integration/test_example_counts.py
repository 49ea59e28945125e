"""Example counts as an attacker claims them: FedAvg weighs an update by its node's claim, so
a claim above the node's stated training-set size, or the job's cap, is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from fedgpu.core import codec
from fedgpu.proto import pb, pb_grpc
from tests.fixtures.federation import Federation, write_job
from tests.fixtures.wire import Probe, update

GLOBAL = {"w": np.zeros(8, np.float32)}


def start(fed: Federation, tmp: Path, **job: Any) -> None:
    init = tmp / "init.safetensors"
    init.write_bytes(codec.encode(GLOBAL).to_bytes())
    spec: dict[str, Any] = dict(rounds=2, min_nodes=2, round_deadline_s=120, evaluate=False,
                                round_retries=3, initial_weights=str(init))
    spec.update(job)
    fed.start_server(write_job(tmp / "job.toml", **spec))


def claims(fed: Federation, stated: dict[str, int], sends: list[tuple[str, int]]) -> list[Any]:
    """Nodes registering with `stated` sizes; then each (node, claim) answers its open task."""
    async def go() -> list[Any]:
        async with grpc.aio.insecure_channel(fed.address) as ch:
            stub = pb_grpc.FederationStub(ch)
            nodes = {n: await Probe(stub, fed.token).register(n, num_examples=k)
                     for n, k in stated.items()}
            out = []
            for name, n in sends:
                p = nodes[name]
                task = await p.task()
                enc, chunks = update({"w": np.ones(8, np.float32)})
                out.append(await p.push(p.header(task, enc, num_examples=n), chunks))
            return out
    return asyncio.run(go())


def refused(reply: Any, words: str) -> None:
    assert isinstance(reply, grpc.aio.AioRpcError), reply
    assert reply.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"update rejected (num_examples): {words}" in reply.details()


def test_claims_beyond_the_stated_size_are_refused(federation: Federation,
                                                   tmp_path: Path) -> None:
    start(federation, tmp_path)
    # a stated 100 at registration; b stated nothing, so its first update states 20.
    out = claims(federation, {"a": 100, "b": 0}, [
        ("a", 10**15), ("b", 20),   # round 1: a's huge claim is refused, the attempt retried
        ("a", 100), ("b", 20),      # round 1 again
        ("a", 60), ("b", 21),       # round 2: b claims more than its first update stated
    ])
    refused(out[0], "a claims 1000000000000000 examples but stated 100")
    assert all(isinstance(r, pb.PushReply) for r in out[1:5]), out[1:5]
    refused(out[5], "b claims 21 examples but stated 20")
    status = federation.query("GetStatus")
    assert status["rejections"]["num_examples"] == 2
    stated = {n["name"]: n["stated_examples"] for n in federation.query("ListNodes")["nodes"]}
    assert stated == {"a": 100, "b": 20}


def test_the_job_caps_every_claim(federation: Federation, tmp_path: Path) -> None:
    start(federation, tmp_path, rounds=1, max_examples_per_node=50)
    out = claims(federation, {"a": 100, "b": 30}, [("a", 100), ("b", 30)])
    refused(out[0], "a claims 100 examples; this job counts at most 50 per node "
                    "(max_examples_per_node)")
    assert isinstance(out[1], pb.PushReply)
