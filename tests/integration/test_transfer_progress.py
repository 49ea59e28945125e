"""Transfer progress during a round, counted (issue 37.4): a real aggregator and one site on the
node's own client of the wire (node/wire_client.py) behind a rate-limited link (the fault proxy's
token bucket, tests/net/fault_proxy.py), weights over gRPC.

While the site downloads the model and then uploads its update, `fedgpu rounds --json`'s `open`
(read through ListRounds, the same document) shows the transfer's direction and its bytes done
growing below the size, as the aggregator sends or receives them; after each, the rate it moved
at (a second, fast site keeps the round open past the slow site's upload). The slow site's own
log shows progress lines during each transfer.

Threat model: none new. The figures are the aggregator's own counts of the bytes it moved; a
site learns nothing from them (they are shown to operators only).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.node.pulled import Pulled
from fedgpu.node.wire_client import WireClient
from fedgpu.proto import pb
from tests.fixtures.federation import Federation, cli, write_job
from tests.net.fault_proxy import FaultProxy

pytestmark = pytest.mark.timeout(120)

# A 24 MiB model over a 3 MB/s link: ~8.4 s each way, well past the node's first progress line.
# Large against the buffers between the two ends (gRPC's flow-control windows, the sockets'):
# a sender counts what it hands over, which runs ahead of the wire by what they hold (~3 MB).
MODEL = {"w": np.zeros(6 << 20, dtype=np.float32)}
RATE = 3_000_000
MAX_BYTES = 1 << 30


def _site(doc: dict[str, Any], name: str) -> dict[str, Any] | None:
    sites = (doc.get("open") or {}).get("sites") or []
    return next((s for s in sites if s["node"] == name), None)


async def _watch(fed: Federation, work: asyncio.Task[Any]) -> list[dict[str, Any]]:
    """The site's entry in the open round, read every 0.3 s until `work` is done."""
    seen: list[dict[str, Any]] = []
    while not work.done():
        doc = await asyncio.to_thread(fed.query, "ListRounds")
        if (site := _site(doc, "slow")) is not None:
            seen.append(site)
        await asyncio.sleep(0.3)
    await work
    return seen


async def _train_task(wire: WireClient, node_id: str) -> Pulled:
    for _ in range(30):
        pulled = await wire.pull(node_id, 1, MAX_BYTES)
        if pulled.header.kind == pb.TASK_KIND_TRAIN:
            if isinstance(pulled.receiver, codec.Assembler):
                pulled.receiver.release()
            return pulled
    raise AssertionError("no training task came")


def _update(node_id: str, pulled: Pulled) -> pb.UpdateHeader:
    return pb.UpdateHeader(node_id=node_id, task_id=pulled.header.task_id,
                           round=pulled.header.round, kind=pulled.header.kind, num_examples=10)


def _moving(seen: list[dict[str, Any]], direction: str, size: int) -> list[int]:
    done = [s["bytes"] for s in seen if s.get("direction") == direction]
    assert all(s["size"] == size for s in seen if s.get("direction") == direction)
    assert any(s.get("rate_bytes_per_s") and s.get("time_left_s") is not None
               for s in seen if s.get("direction") == direction), seen
    return done


def test_rounds_show_each_transfer_s_bytes_growing_during_it_and_the_node_logs_progress(
        tmp_path: Path, federation: Federation, caplog: pytest.LogCaptureFixture) -> None:
    fed = federation
    caplog.set_level(logging.INFO, "fedgpu.node.link")
    init = tmp_path / "init.safetensors"
    enc = codec.encode(MODEL)
    init.write_bytes(enc.to_bytes())
    # No bulk port: the weights take the gRPC path, through the rate-limited proxy.
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--bulk-port", "0")
    # Two sites: the round stays open after the slow site's upload until the fast one answers.
    job = write_job(tmp_path / "job.toml", rounds=1, min_nodes=2, evaluate=False,
                    round_deadline_s=90, initial_weights=str(init))
    with FaultProxy(("127.0.0.1", int(fed.address.rsplit(":", 1)[1])), rate=RATE) as proxy:

        async def scenario() -> tuple[list[dict[str, Any]], dict[str, Any],
                                      list[dict[str, Any]], dict[str, Any]]:
            wire = WireClient(f"127.0.0.1:{proxy.port}", fed.token)
            fast = WireClient(fed.address, fed.token)
            try:
                node_id = (await wire.register(pb.RegisterRequest(
                    node_name="slow", tasks=["digits"]))).node_id
                fast_id = (await fast.register(pb.RegisterRequest(
                    node_name="fast", tasks=["digits"]))).node_id
                r = await asyncio.to_thread(cli, "job", "submit", str(job), "--address",
                                            fed.address)
                assert r.returncode == 0, r.stderr
                pulled_task = asyncio.create_task(_train_task(wire, node_id))
                fast_task = await _train_task(fast, fast_id)
                down = await _watch(fed, pulled_task)
                pulled = pulled_task.result()
                between = _site(await asyncio.to_thread(fed.query, "ListRounds"), "slow")
                assert between is not None
                pushed = asyncio.create_task(wire.push(_update(node_id, pulled),
                                                       codec.encode(MODEL)))
                up = await _watch(fed, pushed)
                reply, transport = pushed.result()
                assert reply.accepted and transport == "grpc", reply.message
                after = _site(await asyncio.to_thread(fed.query, "ListRounds"), "slow")
                assert after is not None
                reply, _ = await fast.push(_update(fast_id, fast_task), codec.encode(MODEL))
                assert reply.accepted, reply.message
                return down, between, up, after
            finally:
                await wire.close()
                await fast.close()

        down, between, up, after = asyncio.run(scenario())
    # After the download: the site trains, and the download's whole size and measured rate
    # are shown (the model as the aggregator encoded it).
    assert between.get("phase") in ("training", None) and "direction" not in between
    last = between["last"]
    model_bytes = last["bytes"]
    assert last["direction"] == "down" and abs(model_bytes - enc.size) < 4096, last
    # During it: its bytes, as sent, grew and stayed below the model's size.
    sent = _moving(down, "down", model_bytes)
    assert sent == sorted(sent) and sent[-1] <= model_bytes, down
    assert len({b for b in sent if 0 < b < model_bytes}) >= 2, down
    assert 0 < last["rate_bytes_per_s"] < RATE * 3, last  # the link's rate plus buffers
    # During the upload: the bytes received grow below the size.
    got = _moving(up, "up", enc.size)
    assert got == sorted(got) and got[-1] <= enc.size, up
    assert len({g for g in got if 0 < g < enc.size}) >= 2, up
    # After it, while the round waits for the other site: the upload's size and rate.
    assert after["last"]["direction"] == "up" and after["last"]["bytes"] == enc.size, after
    assert 0 < after["last"]["rate_bytes_per_s"] < RATE * 2, after
    # The site's own log showed each transfer while it ran (each outlasts a 5 s interval).
    lines = [r.getMessage() for r in caplog.records if r.name == "fedgpu.node.link"]
    for what in ("download over grpc: ", "upload over grpc: "):
        during = [line for line in lines if line.startswith(what)]
        assert during, (what, lines)
        assert " MB in " in during[0] and "s left" in during[0], during
