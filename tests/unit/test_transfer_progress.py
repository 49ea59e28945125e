"""Transfer progress counted, not estimated (issue 37.4): the aggregator's download counter fed
by the senders' blocks (a real socket pair), the node's progress lines (at most one per interval,
none for a transfer shorter than one), and the lines `fedgpu rounds` prints from them."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from fedgpu.cli.link_lines import lines
from fedgpu.core import bulk, codec
from fedgpu.node.transfer_log import TransferLog
from fedgpu.server.transfer.downloads import Downloads
from fedgpu.server.transfer.payload import SEND_BLOCK, ModelPayload


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _model(tmp_path: Path) -> tuple[codec.Encoded, ModelPayload]:
    # Over two send blocks, so a sender reports progress before its end.
    enc = codec.encode({"w": np.arange(SEND_BLOCK // 2 + 1000, dtype=np.float32)})
    path = tmp_path / "global.safetensors"
    path.write_bytes(enc.to_bytes())
    return enc, ModelPayload.from_file(path, enc.digest, codec.DigestAlgo.BLAKE3)


@pytest.mark.parametrize("source", ["file", "memory"])
def test_a_bulk_download_is_counted_block_by_block_and_kept_when_whole(
        tmp_path: Path, source: str) -> None:
    enc, payload = _model(tmp_path)
    if source == "memory":
        payload = ModelPayload.from_encoded(enc)
    downloads = Downloads()
    seen: list[int] = []
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    with a, b:
        with downloads.track("site-a", payload.size, offset=1000) as sent:
            assert downloads.in_flight()["site-a"] is sent

            def send() -> None:
                payload.send(a, 1000, lambda n: (sent.add(n), seen.append(sent.done)))

            t = threading.Thread(target=send)
            t.start()
            asm = codec.Assembler(enc.size, enc.digest, 1 << 30, enc.algorithm)
            asm.add(enc.to_bytes()[:1000])
            bulk.recv_payload(b, asm, idle_s=10)
            t.join()
        assert bytes(asm.finish()) == enc.to_bytes()
    # Progress rose block by block to the whole payload (the resumed start included).
    assert len(seen) >= 2 and seen == sorted(seen) and seen[0] < payload.size
    assert seen[-1] == payload.size
    assert downloads.in_flight() == {}
    last = downloads.last("site-a")
    assert last is not None and last.complete and last.sent == payload.size - 1000
    assert last.rate > 0


def test_a_download_cut_short_is_not_kept_as_finished() -> None:
    downloads = Downloads()
    with pytest.raises(OSError), downloads.track("site-a", 1000) as sent:
        sent.add(400)
        assert downloads.in_flight()["site-a"].done == 400
        raise OSError("reset")
    assert downloads.in_flight() == {} and downloads.last("site-a") is None


def test_finished_downloads_kept_are_bounded() -> None:
    downloads = Downloads(max_kept=2)
    for name in ("a", "b", "c"):
        with downloads.track(name, 10) as sent:
            sent.add(10)
    assert downloads.last("a") is None
    assert downloads.last("b") is not None and downloads.last("c") is not None


def test_the_bulk_sender_reports_bytes_as_it_hands_them_over(tmp_path: Path) -> None:
    enc, _ = _model(tmp_path)
    path = tmp_path / "global.safetensors"
    for source in (path, list(enc.segments)):
        a, b = socket.socketpair()
        a.settimeout(10)
        b.settimeout(10)
        got: list[int] = []
        with a, b:
            t = threading.Thread(target=bulk.send_payload, args=(a, source, 0, got.append))
            t.start()
            asm = codec.Assembler(enc.size, enc.digest, 1 << 30, enc.algorithm)
            bulk.recv_payload(b, asm, idle_s=10)
            t.join()
            assert bytes(asm.finish()) == enc.to_bytes()
        assert sum(got) == enc.size and len(got) >= 2


def test_the_node_logs_progress_at_most_once_an_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    caplog.set_level(logging.INFO, "fedgpu.node.link")
    progress = TransferLog("download over grpc", 10_000_000, every_s=5, clock=clock)
    for _ in range(4):  # 4 MB in 4 s: within the first interval, no line
        clock.now += 1
        progress.add(1_000_000)
    assert caplog.records == []
    clock.now += 1
    progress.add(1_000_000)  # 5 s: a line
    clock.now += 1
    progress.add(1_000_000)  # 6 s: too soon for another
    assert [r.getMessage() for r in caplog.records] == [
        "download over grpc: 5.0/10.0 MB in 5 s at 8.0 Mbit/s, ~5 s left"]
    progress.end()  # stopped short after logging progress: where it stopped
    assert caplog.records[-1].getMessage().startswith("download over grpc stopped: 6.0/10.0 MB")


def test_a_transfer_within_its_first_interval_logs_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    caplog.set_level(logging.INFO, "fedgpu.node.link")
    progress = TransferLog("upload over bulk", 1000, every_s=5, clock=clock)
    clock.now += 4
    progress.add(400)
    progress.end()
    assert caplog.records == []


def test_rounds_lines_show_direction_bytes_rate_and_the_finished_download() -> None:
    doc = {"rounds": [], "open": {"round": 2, "attempt": 1, "deadline_in_s": 9.5, "sites": [
        {"node": "slow", "state": "assigned", "phase": "downloading", "direction": "down",
         "bytes": 1_500_000, "size": 4_000_000, "rate_bytes_per_s": 500_000,
         "time_left_s": 5.0},
        {"node": "fast", "state": "assigned", "phase": "training",
         "last": {"direction": "down", "bytes": 4_000_000, "seconds": 0.25,
                  "rate_bytes_per_s": 16_000_000}}]}}
    assert lines(doc) == [
        "round 2 open, deadline in 9.5 s",
        "  slow downloading down 1.5/4.0 MB at 4.0 Mbit/s ~5 s left",
        "  fast training (down 4.0 MB in 0.2 s at 128.0 Mbit/s)"]
