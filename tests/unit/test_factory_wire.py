"""The agent <-> factory framing (node/rounds/factory_wire.py) over real Unix socket pairs, and the
factory's request checks (node/rounds/fork.py parse_spawn)."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import pytest

from fedgpu.node.rounds import factory_wire as wire
from fedgpu.node.rounds.fork import parse_spawn


def test_messages_and_descriptors_cross_a_socket_pair() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        wire.send(a, {"op": "spawn", "env": {"K": "x" * 100_000}}, fds=[w])
        wire.send(a, {"op": "kill"})
        reader = wire.Reader()
        first = wire.recv_one(b, reader)
        second = wire.recv_one(b, reader)
        assert first == {"op": "spawn", "env": {"K": "x" * 100_000}}
        assert second == {"op": "kill"}
        (passed,) = reader.take_fds()
        os.write(passed, b"through the passed descriptor")
        os.close(passed)
        assert os.read(r, 100) == b"through the passed descriptor"
        a.close()
        assert wire.recv_one(b, reader) is None
    finally:
        for fd in (r, w):
            os.close(fd)
        b.close()


@pytest.mark.parametrize(("raw", "error"), [
    (struct.pack(">I", wire.MAX_MESSAGE + 1), "limit"),
    (struct.pack(">I", 3) + b"[1]", "JSON object"),
    (struct.pack(">I", 3) + b"{no", "not JSON"),
])
def test_bad_frames_are_refused_with_a_reason(raw: bytes, error: str) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        a.sendall(raw)
        a.close()
        with pytest.raises(wire.WireError, match=error):
            wire.recv_one(b, wire.Reader())


def test_a_message_cut_short_is_an_error_not_a_message() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        a.sendall(wire.encode({"op": "spawn"})[:-2])
        a.close()
        with pytest.raises(wire.WireError, match="middle"):
            wire.recv_one(b, wire.Reader())
    with pytest.raises(wire.WireError, match="limit"):
        wire.encode({"x": "y" * wire.MAX_MESSAGE})


def test_spawn_requests_are_checked_field_by_field(tmp_path: Path) -> None:
    good = {"op": "spawn", "workdir": str(tmp_path), "env": {"A": "1"}, "node": "n1",
            "device": "cuda", "gpu_uuid": "GPU-1", "gpu_share": 0.25, "torch_threads": 2,
            "warm": {"task_name": "digits"}}
    spec = parse_spawn(good)
    assert spec.need.resource() == "gpu:GPU-1" and spec.need.units() == 250
    assert (spec.node, spec.torch_threads, spec.env) == ("n1", 2, {"A": "1"})
    for key, value, error in [
        ("workdir", "relative", "absolute"),
        ("workdir", str(tmp_path / "missing"), "existing"),
        ("env", {"A": 1}, "env"),
        ("device", "tpu", "cpu or cuda"),
        ("gpu_share", 1.5, "gpu_share"),
        ("gpu_share", True, "gpu_share"),
        ("torch_threads", 0, "torch_threads"),
        ("node", "x" * 201, "node"),
        ("warm", [1], "warm"),
    ]:
        with pytest.raises(ValueError, match=error):
            parse_spawn({**good, key: value})


def test_a_temp_dir_too_deep_for_a_socket_path_falls_back_to_tmp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedgpu.node.rounds import factory_client

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    made = factory_client.socket_dir()
    try:
        assert made.parent == Path("/tmp") and oct(made.stat().st_mode & 0o777) == "0o700"
        sock = wire.bind(made / factory_client.SOCKET_NAME)  # a real bind at that path
        sock.close()
    finally:
        for p in made.iterdir():
            p.unlink()
        made.rmdir()
    assert list(deep.iterdir()) == []  # the deep one it tried is gone
    shallow = tmp_path / "s"
    shallow.mkdir()
    monkeypatch.setenv("TMPDIR", str(shallow))
    monkeypatch.setattr("tempfile.tempdir", None)
    kept = factory_client.socket_dir()
    assert kept.parent == shallow
