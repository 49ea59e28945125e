"""Slow links count or know why (issue 37.4): a real aggregator, two sites on the node's own
client of the wire (node/wire_client.py, which measures every transfer and reports the rates),
one of them behind a rate-limited link (the fault proxy's token bucket, tests/net/fault_proxy.py).

Round 1 measures the slow site (first contact is always tried). Round 2 then either leaves it
out, with its measured rate and the deadline in the reason (the round record, `fedgpu rounds`,
the site's own poll), or, with `[transfer] slow_sites = "compress"`, asks it for an int8 update
that makes the deadline and folds it as whole weights beside the fast site's.

Threat model: none new. The rates are the site's own claim about its link; a site that lies
can only get itself skipped (understating) or dropped at the deadline as before (overstating),
and a compressed update is checked like any other (names, shapes, finite values, digest) and
only taken from a site that was asked for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.core.update_codecs import UpdateCodec, encode_update
from fedgpu.node.pulled import Pulled
from fedgpu.node.wire_client import WireClient
from fedgpu.proto import pb
from tests.fixtures.bulk_wire import wait_for
from tests.fixtures.federation import Federation, cli, job_dir, write_job
from tests.net.fault_proxy import FaultProxy

pytestmark = pytest.mark.timeout(120)

# A 1 MiB model over a 0.5 MB/s (4 Mbit/s) link: ~2 s each way, ~4 s for a round trip.
MODEL = {"w": np.zeros(1 << 18, dtype=np.float32)}
RATE = 500_000
MAX_BYTES = 1 << 30


async def _site(fed: Federation, name: str, address: str) -> tuple[WireClient, str]:
    wire = WireClient(address, fed.token)
    reg = await wire.register(pb.RegisterRequest(node_name=name, tasks=["digits"]))
    return wire, reg.node_id


async def _train_task(wire: WireClient, node_id: str, timeout: float = 30) -> Pulled:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        pulled = await wire.pull(node_id, 1, MAX_BYTES)
        if pulled.header.kind == pb.TASK_KIND_TRAIN:
            return pulled
    raise AssertionError("no training task came")


def _weights(pulled: Pulled) -> np.ndarray:
    assert pulled.payload is not None
    w = np.array(codec.decode(pulled.payload)[0]["w"])
    if isinstance(pulled.receiver, codec.Assembler):
        pulled.receiver.release()
    return w


def _header(node_id: str, task: pb.TaskHeader, **more: object) -> pb.UpdateHeader:
    return pb.UpdateHeader(node_id=node_id, task_id=task.task_id, round=task.round,
                           kind=task.kind, num_examples=10, **more)  # type: ignore[arg-type]


async def _fast_round(wire: WireClient, node_id: str, add: float) -> None:
    pulled = await _train_task(wire, node_id)
    enc = codec.encode({"w": _weights(pulled) + add})
    reply, _ = await wire.push(_header(node_id, pulled.header), enc)
    assert reply.accepted, reply.message


async def _first_contact(wire: WireClient, node_id: str) -> None:
    """Round 1 at the slow site: the download is measured, the rate reported, the round
    answered at once (a failure: it would miss the deadline anyway)."""
    pulled = await _train_task(wire, node_id)
    _weights(pulled)
    assert wire.link.down > 0  # measured
    await wire.heartbeat(pb.HeartbeatRequest(node_id=node_id, state="idle"))
    try:
        await wire.push(_header(node_id, pulled.header, failed=True,
                                error="test: round 1 only measures"), None)
    except grpc.aio.AioRpcError as exc:
        # On a loaded machine the download may outlast the deadline: then it is late.
        assert "late" in (exc.details() or ""), exc


def _round(fed: Federation, number: int) -> dict:  # type: ignore[type-arg]
    wait_for(lambda: any(r["round"] == number and r["status"] == "finished"
                         for r in fed.query("ListRounds")["rounds"]),
             timeout=60, what=f"round {number} finished")
    return [r for r in fed.query("ListRounds")["rounds"] if r["round"] == number][-1]


def _start(tmp_path: Path, fed: Federation, **job: object) -> Path:
    init = tmp_path / "init.safetensors"
    init.write_bytes(codec.encode(MODEL).to_bytes())
    # No bulk port: the weights take the gRPC path, through the rate-limited proxy.
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--bulk-port", "0")
    return write_job(tmp_path / "job.toml", **{"rounds": 2, **job}, min_nodes=1,
                     evaluate=False, round_retries=3, initial_weights=str(init))


def _submit(fed: Federation, job: Path) -> None:
    r = cli("job", "submit", str(job), "--address", fed.address)
    assert r.returncode == 0, r.stderr


@contextlib.asynccontextmanager
async def _two_sites(fed: Federation, job: Path, proxy_port: int
                     ) -> AsyncIterator[tuple[WireClient, str, WireClient, str]]:
    """A fast site straight to the aggregator and a slow one through the proxy; the job is
    submitted and its round 1 served (the slow site's first contact measures its link)."""
    fast, fast_id = await _site(fed, "fast", fed.address)
    slow, slow_id = await _site(fed, "slow", f"127.0.0.1:{proxy_port}")
    try:
        await asyncio.to_thread(_submit, fed, job)
        await asyncio.gather(_fast_round(fast, fast_id, 1.0), _first_contact(slow, slow_id))
        yield fast, fast_id, slow, slow_id
    finally:
        await fast.close()
        await slow.close()


def test_a_slow_site_is_measured_then_skipped_with_its_rate_and_the_deadline(
        tmp_path: Path, federation: Federation) -> None:
    fed = federation
    job = _start(tmp_path, fed, round_deadline_s=4, rounds=3)
    with FaultProxy(("127.0.0.1", int(fed.address.rsplit(":", 1)[1])), rate=RATE) as proxy:

        async def scenario() -> str:
            async with _two_sites(fed, job, proxy.port) as (fast, fast_id, slow, slow_id):
                # Round 2 is open without it: its next empty poll says why.
                told = ""
                for _ in range(20):
                    pulled = await slow.pull(slow_id, 1, MAX_BYTES)
                    assert pulled.header.kind == pb.TASK_KIND_NONE
                    if pulled.header.message:
                        told = pulled.header.message
                        break
                await _fast_round(fast, fast_id, 1.0)
                await _fast_round(fast, fast_id, 1.0)
                return told

        told = asyncio.run(scenario())
    second = _round(fed, 2)
    assert second["participants"] == sorted(n["node_id"] for n in fed.query("ListNodes")["nodes"]
                                            if n["name"] == "fast")
    link = second["link"]
    assert [s["node"] for s in link["skipped"]] == ["slow"]
    reason = link["skipped"][0]["reason"]
    m = re.fullmatch(r"needs ~(\d+) s at ([\d.]+) Mbit/s, deadline 4 s", reason)
    assert m, reason
    # The rate measured through the 4 Mbit/s bucket (latency makes it a little slower).
    assert 2.5 <= float(m[2]) <= 4.4, reason
    assert int(m[1]) >= 3
    assert told and reason in told
    assert link["rates"]["slow"]["down_bytes_per_s"] < RATE * 1.1
    shown = cli("rounds", "--address", fed.address)
    assert shown.returncode == 0, shown.stderr
    assert f"skipped slow: {reason}" in shown.stdout
    events = cli("job", "logs", fed.query("ListRounds")["job_id"], "--address", fed.address)
    assert events.returncode == 0, events.stderr
    assert f"skipping slow: {reason}" in events.stdout


def test_with_compress_the_slow_site_sends_an_int8_update_that_makes_the_deadline(
        tmp_path: Path, federation: Federation) -> None:
    fed = federation
    # Whole updates: ~4.2 s at 0.5 MB/s, over 90% of the deadline; int8: ~2.7 s, within it.
    job = _start(tmp_path, fed, round_deadline_s=4.5, transfer={"slow_sites": "compress"})
    with FaultProxy(("127.0.0.1", int(fed.address.rsplit(":", 1)[1])), rate=RATE) as proxy:

        async def slow_round_two(slow: WireClient, slow_id: str) -> float:
            pulled = await _train_task(slow, slow_id)
            asked = json.loads(pulled.header.hyperparameters_json)
            assert asked["update_codec"] == UpdateCodec.INT8.value
            _weights(pulled)
            tensors, meta = encode_update({"w": np.ones_like(MODEL["w"])}, UpdateCodec.INT8)
            enc = codec.encode(tensors, meta)
            assert enc.size < MODEL["w"].nbytes / 3
            reply, _ = await slow.push(_header(slow_id, pulled.header), enc)
            assert reply.accepted, reply.message
            return slow.link.up

        async def scenario() -> float:
            async with _two_sites(fed, job, proxy.port) as (fast, fast_id, slow, slow_id):
                _, up = await asyncio.gather(_fast_round(fast, fast_id, 3.0),
                                             slow_round_two(slow, slow_id))
                return up

        up = asyncio.run(scenario())
    second = _round(fed, 2)
    assert second["attempt"] == 1 and second["dropped"] == []
    assert sorted(u["node"] for u in second["updates"]) == ["fast", "slow"]
    assert second["duration_s"] < 4.5
    [asked] = second["link"]["compressed"]
    assert asked["node"] == "slow" and asked["codec"] == "int8"
    assert "deadline 4.5 s: asked for an int8 update" in asked["reason"]
    assert 0 < up < RATE * 1.1  # its upload was measured too
    # Round 1 made MODEL + 1; round 2 averages fast's MODEL + 4 with slow's delta of +1
    # (MODEL + 2) as whole weights.
    tensors, _ = codec.decode(bytearray(
        (job_dir(tmp_path / "state") / "global.safetensors").read_bytes()))
    np.testing.assert_allclose(tensors["w"], MODEL["w"] + 3.0, atol=1e-2)
