"""Updates larger than the aggregator's upload memory budget, spilled to disk and folded from
there (server/transfer/spool.py), against real aggregators on loopback: raw clients push over
gRPC and the bulk port.

Threat model (the spool's): a node announcing and sending huge updates to fill the
aggregator's disk. The spool holds at most --upload-spool-mib; a spill past it is refused as
too_large with the reason, and the uploads already in flight, and the round, go on untouched.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from fedgpu.core import bulk, codec
from fedgpu.proto import pb, pb_grpc
from tests.fixtures.federation import Federation, free_port, job_dir, write_job
from tests.fixtures.wire import Probe, update

# 3 MiB of float32 in three tensors: three times a 1 MiB budget.
GLOBAL = {"a": np.zeros((256, 1024), np.float32), "b": np.zeros(1 << 19, np.float32),
          "c": np.zeros(7, np.float32)}
MIB = 1 << 20


def updates() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in GLOBAL.items()}
            for _ in range(3)]


def start(fed: Federation, tmp: Path, *flags: str, min_nodes: int = 3,
          deadline_s: int = 120) -> Path:
    init = tmp / "init.safetensors"
    init.write_bytes(codec.encode(GLOBAL).to_bytes())
    job = write_job(tmp / "job.toml", rounds=1, min_nodes=min_nodes, min_available_nodes=3,
                    round_deadline_s=deadline_s, evaluate=False, round_retries=0,
                    initial_weights=str(init))
    state = tmp / "state"
    fed.start_server(job, "--state-dir", str(state), "--heartbeat-s", "30", *flags)
    return state


async def register(fed: Federation, ch: grpc.aio.Channel, n: int) -> list[Probe]:
    stub = pb_grpc.FederationStub(ch)
    return [await Probe(stub, fed.token).register(f"site-{i}") for i in range(n)]


async def push_grpc(probe: Probe, tensors: dict[str, np.ndarray], examples: int) -> Any:
    task = await probe.task()
    enc, chunks = update(tensors, chunk=256 << 10)
    return await probe.push(probe.header(task, enc, num_examples=examples), chunks)


async def push_bulk(probe: Probe, port: int, tensors: dict[str, np.ndarray],
                    examples: int) -> bulk.Status:
    task = await probe.task()
    enc = codec.encode(tensors)
    ticket = await probe.stub.OpenUpload(probe.header(task, enc, num_examples=examples),
                                         metadata=probe.md, timeout=30)
    return await asyncio.to_thread(bulk.upload, "127.0.0.1", port, None, ticket.ticket,
                                   enc.segments)


def one_round(tmp: Path, *flags: str) -> tuple[bytes, dict[str, Any], Path]:
    """Three sites, one after the other (so every run folds them in the same order), two over
    gRPC and one over the bulk port; the global model's file, the uploads' status, the
    spool directory."""
    tmp.mkdir()
    fed = Federation(tmp)
    port = free_port()
    try:
        state = start(fed, tmp, "--bulk-port", str(port), *flags)

        async def run() -> None:
            async with grpc.aio.insecure_channel(fed.address) as ch:
                sites = await register(fed, ch, 3)
                ups = updates()
                got = await push_grpc(sites[0], ups[0], 5)
                assert isinstance(got, pb.PushReply) and got.accepted, got
                status = await push_bulk(sites[1], port, ups[1], 7)
                assert status.ok, status
                got = await push_grpc(sites[2], ups[2], 11)
                assert isinstance(got, pb.PushReply) and got.accepted, got

        asyncio.run(run())
        fed.wait_state(("finished",), timeout=60)
        uploads = fed.query("GetStatus")["uploads"]
        return (job_dir(state) / "global.safetensors").read_bytes(), uploads, state / "spool"
    finally:
        fed.stop()


def test_updates_past_the_memory_budget_fold_from_disk_bit_equal(tmp_path: Path) -> None:
    big, in_memory, _ = one_round(tmp_path / "memory")
    small, spilled, spool = one_round(tmp_path / "spill", "--upload-memory-mib", "1",
                                      "--upload-spool-mib", "16")
    assert in_memory["spilled"] == 0
    assert spilled["spilled"] == 3, spilled
    # Bit-equal: the same bytes in the same order through the same kernels.
    assert small == big
    model = codec.decode(bytearray(small))[0]
    assert not np.array_equal(model["a"], GLOBAL["a"])
    # The budget held: the spilled updates' write buffers were all it reserved.
    assert 0 < spilled["memory_peak_bytes"] <= spilled["memory_budget_bytes"] == MIB
    assert 3 * MIB <= spilled["spool_peak_bytes"] <= 16 * MIB
    assert spilled["spool_used_bytes"] == 0 and spilled["memory_reserved_bytes"] == 0
    assert spool.is_dir() and list(spool.iterdir()) == []


def test_a_spill_past_the_spool_budget_is_refused_and_loses_nothing_else(
        tmp_path: Path) -> None:
    fed = Federation(tmp_path)
    try:
        # A leftover of a crashed aggregator is gone at start-up.
        (tmp_path / "state" / "spool").mkdir(parents=True)
        (tmp_path / "state" / "spool" / "upload-leftover").write_bytes(b"x")
        # Room on disk for one spilled update (3 MiB) at a time, not two; two updates of the
        # three make the round.
        state = start(fed, tmp_path, "--upload-memory-mib", "1", "--upload-spool-mib", "5",
                      min_nodes=2)
        assert list((state / "spool").iterdir()) == []

        async def spool_used() -> int:
            doc = await asyncio.to_thread(fed.query, "GetStatus")
            return int(doc["uploads"]["spool_used_bytes"])

        async def run() -> tuple[Any, Any, Any, int]:
            async with grpc.aio.insecure_channel(fed.address) as ch:
                first, hostile, third = await register(fed, ch, 3)
                ups = updates()
                # The first holds its room on disk: every byte sent, the stream kept open.
                task = await first.task()
                enc, chunks = update(ups[0], chunk=256 << 10)
                hold = asyncio.Event()
                held = asyncio.create_task(first.push(
                    first.header(task, enc, num_examples=5), chunks, stall=hold))
                for _ in range(100):
                    if await spool_used():
                        break
                    await asyncio.sleep(0.1)
                # Announced past the whole spool: refused before a byte lands anywhere.
                task = await hostile.task()
                big = {"a": np.zeros(2 << 20, np.float32)}  # 8 MiB
                enc, _ = update(big, chunk=256 << 10)
                # Only the header goes before the answer: a chunk written while the server ends
                # the call makes grpc's client report INTERNAL in place of the server's status.
                refused = await hostile.push(hostile.header(task, enc, num_examples=7),
                                             stall=asyncio.Event(), timeout=30)
                # The third fits the spool but not beside the first: it waits for room.
                later = asyncio.create_task(push_grpc(third, ups[2], 11))
                await asyncio.sleep(1.0)
                during = await spool_used()
                hold.set()
                return await held, refused, await later, during

        held, refused, third, during = asyncio.run(run())
        assert isinstance(refused, grpc.aio.AioRpcError)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "spool" in refused.details() and "too_large" in refused.details(), \
            refused.details()
        assert isinstance(held, pb.PushReply) and held.accepted, held
        assert isinstance(third, pb.PushReply) and third.accepted, third
        fed.wait_state(("finished",), timeout=60)
        (rec,) = [r for r in fed.query("ListRounds")["rounds"] if r["status"] == "finished"]
        assert sorted(u["node"] for u in rec["updates"]) == ["site-0", "site-2"]
        uploads = fed.query("GetStatus")["uploads"]
        assert uploads["spool_refused"] == 1 and uploads["spilled"] == 2, uploads
        # Never more on disk than the spool's budget: the third waited for the first.
        assert during == uploads["spool_peak_bytes"] < 5 * MIB, (during, uploads)
        assert uploads["spool_used_bytes"] == 0
        assert list((state / "spool").iterdir()) == []
    finally:
        fed.stop()


def test_a_broken_spill_kept_for_its_resume_goes_when_its_round_ends(tmp_path: Path) -> None:
    fed = Federation(tmp_path)
    try:
        state = start(fed, tmp_path, "--upload-memory-mib", "1", min_nodes=2, deadline_s=8)

        async def run() -> tuple[Any, dict[str, Any]]:
            async with grpc.aio.insecure_channel(fed.address) as ch:
                broken, *others = await register(fed, ch, 3)
                ups = updates()
                # Half its bytes, then the stream ends: refused as truncated, kept on disk.
                task = await broken.task()
                enc, chunks = update(ups[0], chunk=256 << 10)
                cut = await broken.push(broken.header(task, enc, num_examples=5),
                                        chunks[:len(chunks) // 2])
                kept = (await asyncio.to_thread(fed.query, "GetStatus"))["uploads"]
                for site, up in zip(others, ups[1:], strict=True):
                    got = await push_grpc(site, up, 7)
                    assert isinstance(got, pb.PushReply) and got.accepted, got
                return cut, kept

        cut, kept = asyncio.run(run())
        assert isinstance(cut, grpc.aio.AioRpcError) and "truncated" in cut.details()
        assert kept["parked_for_resume"] == 1 and kept["spool_used_bytes"] > 0, kept
        assert len(list((state / "spool").iterdir())) == 1
        fed.wait_state(("finished",), timeout=60)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            uploads = fed.query("GetStatus")["uploads"]
            if not uploads["parked_for_resume"]:
                break
            time.sleep(0.5)
        assert uploads["parked_for_resume"] == 0 and uploads["expired_unresumed"] == 1
        assert uploads["spool_used_bytes"] == 0
        assert list((state / "spool").iterdir()) == []
    finally:
        fed.stop()
