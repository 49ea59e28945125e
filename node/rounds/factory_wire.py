"""The local protocol between node agents and the worker factory (node/rounds/factory.py).

A Unix stream socket; each message is a 4-byte big-endian length and a JSON object (never
pickle), at most MAX_MESSAGE bytes. The spawn request carries the agent's stdout and stderr as
file descriptors (SCM_RIGHTS), so the round's worker logs where the agent's own round workers
always have. One connection is one worker: the agent sends `spawn`, the factory answers
`started` (after any wait for a slot) and `exited`; the agent may send `kill`. The connection
closing — the agent died — makes the factory kill that worker.

Torch-free: the agent imports it.
"""

from __future__ import annotations

import array
import json
import os
import socket
import stat
import struct
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

MAX_MESSAGE = 1 << 20
MAX_FDS = 4
_HEADER = struct.Struct(">I")


class Op(StrEnum):
    """What an agent asks of the factory."""

    SPAWN = "spawn"
    KILL = "kill"


class Event(StrEnum):
    """What the factory tells an agent about its worker."""

    STARTED = "started"
    EXITED = "exited"
    REFUSED = "refused"


class WireError(Exception):
    """A message that is too large, not JSON, not an object, or a connection cut mid-message."""


def encode(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise WireError(f"message of {len(body)} bytes is over the {MAX_MESSAGE}-byte limit")
    return _HEADER.pack(len(body)) + body


def send(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    data = encode(obj)
    if fds:
        # The descriptors ride on the first bytes; the rest follows as a plain stream.
        sent = sock.sendmsg([data[:_HEADER.size]],
                            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    sock.sendall(data)


@dataclass
class Reader:
    """Incremental frame reader for one connection (blocking or not): feed it what arrives."""

    buf: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)
    # Parsed but not yet handed out (recv_one returns one message at a time).
    pending: deque[dict[str, Any]] = field(default_factory=deque)

    def receive(self, sock: socket.socket, size: int = 65536) -> bool:
        """Read once; False when the peer closed the connection."""
        fds = array.array("i")
        data, ancdata, _flags, _addr = sock.recvmsg(size, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % fds.itemsize
                fds.frombytes(payload[:usable])
        self.fds.extend(fds)
        if not data:
            return False
        self.buf.extend(data)
        return True

    def messages(self) -> list[dict[str, Any]]:
        """Every complete message buffered so far."""
        out: list[dict[str, Any]] = []
        while len(self.buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buf)
            if size > MAX_MESSAGE:
                raise WireError(f"message of {size} bytes announced; the limit is {MAX_MESSAGE}")
            if len(self.buf) < _HEADER.size + size:
                break
            body = bytes(self.buf[_HEADER.size:_HEADER.size + size])
            del self.buf[:_HEADER.size + size]
            try:
                obj = json.loads(body)
            except ValueError as exc:
                raise WireError(f"not JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise WireError(f"a message must be a JSON object, got {type(obj).__name__}")
            out.append(obj)
        return out

    def take_fds(self) -> list[int]:
        fds, self.fds = self.fds, []
        return fds


def recv_one(sock: socket.socket, reader: Reader) -> dict[str, Any] | None:
    """Block (within the socket's timeout) for the next message; None when the peer closed."""
    while not reader.pending:
        if not reader.receive(sock):
            if reader.buf:
                raise WireError("connection closed in the middle of a message")
            return None
        reader.pending.extend(reader.messages())
    return reader.pending.popleft()


def check_socket_dir(path: Path) -> None:
    """The socket's directory must be ours and closed to everyone else: that, and the peer uid
    check on every connection, is what keeps other users from running code through us. A
    missing one is made so."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
        path.parent.chmod(0o700)  # whatever the umask
    st = path.parent.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise SystemExit(f"fedgpu factory: {path.parent} must belong to uid {os.getuid()} and "
                         f"be private (chmod 700); it is uid {st.st_uid}, mode "
                         f"{stat.S_IMODE(st.st_mode):o}")


def bind(path: Path) -> socket.socket:
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SystemExit(f"fedgpu factory: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # left by a factory that died: nobody listens on it
        else:
            raise SystemExit(f"fedgpu factory: another factory already serves {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock
