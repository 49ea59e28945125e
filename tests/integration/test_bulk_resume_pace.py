"""How soon the node's bulk client resumes a cut transfer (issue 37, point 6): node/bulk_client.py
on node/resume_backoff.py's rule, against a real aggregator's bulk port behind a fault proxy
(tests/net/fault_proxy.py) that cuts the connection mid-payload.

A resume after a connection that moved bytes goes at once (a fixed 0.5 s pause was most of what
a cut cost a 64 MiB bulk upload over a 200 ms round trip: BENCHMARKS.md section 19); resumes
that move nothing back off. The client's pauses are recorded by the sleep it is given, so what
is asserted is the decision, not how fast this machine is.

Threat model: a node whose resumes move nothing (the aggregator down or restarting, the link
gone) must not reconnect in a tight loop (a fleet doing so floods an aggregator as it comes
back), must hand the break back to its caller within a bounded time (a stopped node's transfer
ends within core/lifetime.py's STOP_LIMIT_S), and loses nothing: the bytes the aggregator kept
stay with the ticket for a later resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.core.lifetime import STOP_LIMIT_S
from fedgpu.node.bulk_client import RESUMES, BulkPath, BulkRpcError
from fedgpu.node.resume_backoff import MAX_PAUSE_S, PAUSE_S
from fedgpu.proto import pb
from tests.fixtures.bulk_wire import Wire, served, wait_for
from tests.net.fault_proxy import FaultProxy, Way

pytestmark = pytest.mark.timeout(120)

# 4 MiB: a cut at half lands mid-stream, and the module stays at a few seconds.
MODEL = {"w": np.arange(1 << 20, dtype=np.float32) / (1 << 20)}


@pytest.fixture(scope="module", name="wire")
def wire_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    with served(tmp_path_factory.mktemp("pace"), MODEL, "--upload-idle-s", "60", rounds=10,
                round_retries=5, node_name="pace") as wire:
        yield wire


def _path(pauses: list[float], on_pause: Callable[[], object] | None = None) -> BulkPath:
    """A bulk client whose pauses before a resume are recorded (and not slept)."""

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if on_pause is not None:
            on_pause()

    path = BulkPath("127.0.0.1:1", None, sleep=sleep)
    path.reset(1)  # every call below names its port
    return path


def _update(task: pb.TaskHeader) -> codec.Encoded:
    return codec.encode({"w": MODEL["w"] * 2.0 + task.round})


def _counted_once(wire: Wire, number: int) -> None:
    def finished() -> list[dict]:  # type: ignore[type-arg]
        return [r for r in wire.fed.query("ListRounds")["rounds"]
                if r["round"] == number and r["status"] == "finished"]

    wait_for(lambda: bool(finished()), timeout=30, what=f"round {number} finished")
    rec = finished()[-1]
    assert rec["attempt"] == 1 and len(rec["updates"]) == 1, rec


def test_a_cut_download_and_upload_resume_at_once(wire: Wire) -> None:
    task = wire.task()
    pauses: list[float] = []
    path = _path(pauses)
    asm = codec.Assembler(task.payload_size, task.payload_digest, 1 << 30, codec.WIRE_DIGEST)
    with FaultProxy(("127.0.0.1", wire.bulk_port)) as proxy:
        proxy.cut(Way.DOWN, task.payload_size // 2)
        path.download(task.bulk.ticket, proxy.port, asm)
        assert proxy.connections == 2
    asm.finish()  # whole, and checked against the header's digest
    asm.release()
    assert pauses == [0.0] and path.resumed == 1

    enc = _update(task)
    ticket = wire.stub.OpenUpload(wire.header(task, enc), metadata=wire.md, timeout=10)
    with FaultProxy(("127.0.0.1", wire.bulk_port)) as proxy:
        proxy.cut(Way.UP, enc.size // 2)
        assert "accepted" in path.upload(ticket.ticket, proxy.port, enc.segments)
        assert proxy.connections == 2
    assert pauses == [0.0, 0.0] and path.resumed == 2
    _counted_once(wire, task.round)


def test_resumes_against_a_link_gone_down_back_off_and_keep_the_bytes(wire: Wire) -> None:
    """The upload is cut at half and the link stays down (the proxy is gone at the first
    resume): the first resume goes at once, the ones that find nothing back off, the break is
    handed back after RESUMES of them, and the aggregator still holds what it got: the same
    ticket later sends only the rest, counted once."""
    task = wire.task()
    enc = _update(task)
    ticket = wire.stub.OpenUpload(wire.header(task, enc), metadata=wire.md, timeout=10)
    uploads = wire.status()["uploads"]
    parked, resumed_before = uploads["parked_for_resume"], uploads["resumed"]
    pauses: list[float] = []
    with FaultProxy(("127.0.0.1", wire.bulk_port)) as proxy:

        def link_down() -> None:
            # Once the aggregator has seen the cut (a proxy closed under a connection it still
            # reads would leave that connection to its rate watchdog, 10 s later).
            wait_for(lambda: wire.status()["uploads"]["parked_for_resume"] == parked + 1,
                     timeout=10, what="the cut upload's bytes parked")
            proxy.close()

        path = _path(pauses, on_pause=lambda: len(pauses) == 1 and link_down())
        proxy.cut(Way.UP, enc.size // 2)
        with pytest.raises(BulkRpcError) as broke:
            path.upload(ticket.ticket, proxy.port, enc.segments)
    assert broke.value.code() is grpc.StatusCode.UNAVAILABLE
    assert len(pauses) == RESUMES and pauses[0] == 0.0
    assert pauses[1:] == [PAUSE_S, 2 * PAUSE_S] + [MAX_PAUSE_S] * (RESUMES - 3)
    assert sum(pauses) < STOP_LIMIT_S / 2
    assert path.usable  # one broken transfer does not give up the bulk port

    again: list[float] = []
    resumed = _path(again)
    assert "accepted" in resumed.upload(ticket.ticket, wire.bulk_port, enc.segments)
    uploads = wire.status()["uploads"]
    # It continued from the parked bytes (taken up once), not from the payload's first byte.
    assert again == [] and uploads["resumed"] == resumed_before + 1
    assert uploads["parked_for_resume"] == parked
    _counted_once(wire, task.round)
