"""Transfer progress during a round, counted (issue 37.4): a real aggregator and one site on the
node's own client of the wire (node/wire_client.py) behind a rate-limited link (the fault proxy's
token bucket, tests/net/fault_proxy.py), weights over either path: gRPC chunks, or the bulk port.

While the site downloads the model and then uploads its update, `fedgpu rounds --json`'s `open`
(read through ListRounds, the same document) shows the transfer's direction and its bytes done
growing below the size, as the aggregator sends or receives them, with a rate and the time left;
after each, the rate it moved at (a second, fast site keeps the round open past the slow site's
upload). The slow site's own log shows progress lines during each transfer, named for its path,
and the round's record says which path the update took.

The bulk path: a site reaches the bulk port at the host of its aggregator address and the port
the aggregator advertised, so the slow site is given the aggregator address 127.0.0.2 (a plain
proxy to the gRPC port) and the rate-limited proxy listens on 127.0.0.2 at the aggregator's bulk
port, forwarding to the aggregator, which listens on 127.0.0.1 only (all of 127.0.0.0/8 is
loopback). The bytes that crossed that proxy show the weights took the bulk port.

Threat model: none new. The figures are the aggregator's own counts of the bytes it moved; a
site learns nothing from them (they are shown to operators only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.node.pulled import Pulled
from fedgpu.node.wire_client import WireClient
from fedgpu.proto import pb
from tests.fixtures.federation import Federation, cli, free_port, write_job
from tests.net.fault_proxy import FaultProxy, Way

pytestmark = pytest.mark.timeout(120)

# A 24 MiB model over a 3 MB/s link: ~8.4 s each way, well past the node's first progress line.
# Large against the buffers between the two ends (gRPC's flow-control windows, the sockets'):
# a sender counts what it hands over, which runs ahead of the wire by what they hold (~3 MB).
MODEL = {"w": np.zeros(6 << 20, dtype=np.float32)}
RATE = 3_000_000
MAX_BYTES = 1 << 30
# The slow site's aggregator address on the bulk path: another loopback address, where a proxy
# can take the bulk port's number while the aggregator holds it on 127.0.0.1.
ELSEWHERE = "127.0.0.2"


@contextlib.contextmanager
def _slow_link(fed: Federation, path: str, state: Path) -> Iterator[tuple[str, FaultProxy]]:
    """The aggregator, started for `path`, and the slow site's way to it: the aggregator
    address it is given and the rate-limited proxy its weights cross."""
    port = free_port()
    if path == "grpc":
        # No bulk port: the weights take the gRPC path, through the rate-limited proxy.
        fed.start_server(None, "--state-dir", str(state), "--bulk-port", "0", port=port)
        with FaultProxy(("127.0.0.1", port), rate=RATE) as proxy:
            yield f"127.0.0.1:{proxy.port}", proxy
        return
    bulk_port = free_port()
    fed.start_server(None, "--state-dir", str(state), "--bulk-port", str(bulk_port),
                     port=port)
    # The gRPC calls cross at loopback speed; only the bulk port's link is slow.
    with FaultProxy(("127.0.0.1", port), host=ELSEWHERE) as calls, \
            FaultProxy(("127.0.0.1", bulk_port), host=ELSEWHERE, port=bulk_port,
                       rate=RATE) as proxy:
        yield f"{ELSEWHERE}:{calls.port}", proxy


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


@pytest.mark.parametrize("path", ["grpc", "bulk"])
def test_rounds_show_each_transfer_s_bytes_growing_during_it_and_the_node_logs_progress(
        tmp_path: Path, federation: Federation, caplog: pytest.LogCaptureFixture,
        path: str) -> None:
    fed = federation
    caplog.set_level(logging.INFO, "fedgpu.node.link")
    init = tmp_path / "init.safetensors"
    enc = codec.encode(MODEL)
    init.write_bytes(enc.to_bytes())
    # Two sites: the round stays open after the slow site's upload until the fast one answers.
    job = write_job(tmp_path / "job.toml", rounds=1, min_nodes=2, evaluate=False,
                    round_deadline_s=90, initial_weights=str(init))
    with _slow_link(fed, path, tmp_path / "state") as (address, proxy):

        async def scenario() -> tuple[list[dict[str, Any]], dict[str, Any],
                                      list[dict[str, Any]], dict[str, Any]]:
            wire = WireClient(address, fed.token)
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
                assert reply.accepted and transport == path, (transport, reply.message)
                after = _site(await asyncio.to_thread(fed.query, "ListRounds"), "slow")
                assert after is not None
                reply, _ = await fast.push(_update(fast_id, fast_task), codec.encode(MODEL))
                assert reply.accepted, reply.message
                return down, between, up, after
            finally:
                await wire.close()
                await fast.close()

        down, between, up, after = asyncio.run(scenario())
        # The weights crossed the slow link, each way (the bulk port's proxy on that path).
        assert proxy.carried[Way.DOWN] >= enc.size and proxy.carried[Way.UP] >= enc.size, \
            proxy.carried
    fed.wait_state(("finished",), timeout=30)
    (rec,) = [r for r in fed.query("ListRounds")["rounds"] if r["round"] == 1]
    assert {u["node"]: u.get("transport") for u in rec["updates"]}["slow"] == path, rec
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
    for what in (f"download over {path}: ", f"upload over {path}: "):
        during = [line for line in lines if line.startswith(what)]
        assert during, (what, lines)
        assert " MB in " in during[0] and "s left" in during[0], during
