"""The bulk data path: weights over a plain TCP connection beside the gRPC control plane.

Why not gRPC: in Python each gRPC chunk is copied about four times and crosses the GIL twice,
which caps a stream at ~20% of what the socket carries; a socket read with `recv_into` lands
the bytes straight in the payload's buffer. Why not an existing library: HTTP clients and
servers (aiohttp, urllib3) copy every body chunk into a new bytes object and would add a
second stack to secure; ZeroMQ and friends add a broker-less messaging layer the bulk path
does not need. What is left is small: a ticket, a status frame and the payload's bytes.

The conversation (TLS or mutual TLS around all of it when the gRPC port uses TLS):

    client -> "FGB1" | u16 ticket length | ticket          (a one-time ticket from gRPC)
           or "FGB2" | u16 ticket length | ticket | u64 offset   (a download resumed)
    server -> status frame                                  (go ahead, or why not)
    download: server -> payload_size - offset bytes
    upload:   server's go-ahead names `offset`, the bytes it already holds of this ticket's
              payload; client -> payload_size - offset bytes; server -> status frame (verdict)

Resume: a ticket outlives a connection that broke for RESUME_TTL_S. Presented again, a
download continues at the offset the node asks for, an upload at the offset the aggregator
names: the end of the last segment the receiver verified against the segment digests its
header announced (fedgpu/core/segments.py; the bytes held when none were announced). Each
segment is checked as it lands and the whole payload against its digest before it is used,
so a resumed payload is as verified as one sent in one piece.

A status frame is a u32 length and a JSON object {"ok", "code", "reason", "message"}; `code`
is the gRPC status name the same outcome gets on the gRPC path, so callers handle one kind of
error. Integers are big-endian.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from fedgpu.core import codec
from fedgpu.core.digest_sink import RECV_BLOCK, DigestSink
from fedgpu.core.tls import TlsFiles, ssl_client_context

MAGIC = b"FGB1"
RESUME_MAGIC = b"FGB2"
MAX_TICKET = 256
MAX_STATUS = 64 << 10
# How often a receiver reports progress (the upload's last byte time in `fedgpu status`).
PROGRESS_BYTES = 1 << 20
CONNECT_TIMEOUT_S = 10.0
# A transfer slower than this on average (after the grace period) is cut off: a sender or
# reader that trickles a byte now and then would hold a slot of the bulk port for hours.
MIN_RATE_BPS = 32 << 10
RATE_GRACE_S = 10.0
# After the last byte of an upload the aggregator validates and aggregates before it answers
# (seconds for a multi-GB model, and it may wait for another update's aggregation).
VERDICT_TIMEOUT_S = 3600.0
# How long a ticket whose connection broke may be presented again to resume its transfer (and
# how long the aggregator keeps a broken upload's bytes, within its upload memory budget).
RESUME_TTL_S = 120.0


class Direction(StrEnum):
    UPLOAD = "upload"
    DOWNLOAD = "download"


@dataclass(frozen=True)
class Status:
    ok: bool
    code: str = "OK"       # the gRPC status code name of the same outcome on the gRPC path
    reason: str = ""       # a refusal's counter key (server/states.Reject or a ticket reason)
    message: str = ""
    offset: int = 0        # an upload's go-ahead: bytes of the payload the aggregator holds

    def frame(self) -> bytes:
        body = json.dumps(asdict(self)).encode()[:MAX_STATUS]
        return struct.pack(">I", len(body)) + body


class TooSlow(TimeoutError):
    """A transfer that fell below its minimum rate."""


class BulkUnreachable(OSError):
    """The bulk port cannot be reached or its TLS handshake fails: use gRPC instead."""


class BulkProtocolError(ValueError):
    """The other side broke the bulk conversation (bad magic, oversized frame, early EOF)."""


class TurnedAway(OSError):
    """The aggregator closed the connection before its first status frame: its pre-ticket gate
    or its transfer slots were full (a burst of sites behind one address). The ticket was not
    redeemed, so trying again shortly is safe."""


class ClosedQuietly(BulkProtocolError):
    """The client hung up without sending a byte: a reachability probe (`fedgpu doctor`, a
    load balancer's TCP check), not a refusal."""


def host_of(address: str) -> str:
    """The host part of a gRPC target "host:port" (brackets of an IPv6 literal removed)."""
    host = address.rpartition(":")[0] if ":" in address else address
    if host.startswith("dns:"):
        host = host.removeprefix("dns:").lstrip("/")
    return host.strip("[]")


def connect(host: str, port: int, tls: TlsFiles | None,
            timeout: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """A connected (and, with `tls`, handshaken) blocking socket; BulkUnreachable if not."""
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise BulkUnreachable(f"cannot connect to the bulk port {host}:{port}: "
                              f"{exc.strerror or exc}") from None
    # The status frames are small and answered at once.
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is None:
        return raw
    try:
        return ssl_client_context(tls).wrap_socket(raw, server_hostname=host)
    except (ssl.SSLEOFError, ConnectionError) as exc:
        # Closed during the handshake: turned away at the door, not a TLS mismatch.
        raw.close()
        raise TurnedAway(f"the bulk port {host}:{port} closed the TLS handshake: {exc}") from None
    except (ssl.SSLError, OSError) as exc:
        raw.close()
        raise BulkUnreachable(f"TLS handshake with the bulk port {host}:{port} failed: "
                              f"{getattr(exc, 'reason', None) or exc}") from None


def recv_exact(sock: socket.socket, n: int,
               unstarted: type[Exception] = BulkProtocolError) -> bytes:
    """`n` bytes; `unstarted` is raised when the connection ends before the first of them."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise (BulkProtocolError if got else unstarted)(
                f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send_ticket(sock: socket.socket, ticket: str, offset: int = 0) -> None:
    """The hello: the ticket, and for a resumed download the offset to continue from."""
    raw = ticket.encode()
    if not 0 < len(raw) <= MAX_TICKET:
        raise BulkProtocolError(f"a ticket is 1-{MAX_TICKET} bytes")
    if offset:
        sock.sendall(RESUME_MAGIC + struct.pack(">H", len(raw)) + raw + struct.pack(">Q", offset))
    else:
        sock.sendall(MAGIC + struct.pack(">H", len(raw)) + raw)


def read_hello(sock: socket.socket) -> tuple[str, int]:
    """The ticket a connection presents and the offset it resumes from (0: from the start)."""
    first = sock.recv(1)
    if not first:
        raise ClosedQuietly("closed before sending anything")
    head = first + recv_exact(sock, len(MAGIC) + 1)
    magic = head[: len(MAGIC)]
    if magic not in (MAGIC, RESUME_MAGIC):
        raise BulkProtocolError("not a fedgpu bulk connection (bad magic)")
    (length,) = struct.unpack(">H", head[len(MAGIC):])
    if not 0 < length <= MAX_TICKET:
        raise BulkProtocolError(f"ticket of {length} bytes (at most {MAX_TICKET})")
    try:
        token = recv_exact(sock, length).decode("ascii")
    except UnicodeDecodeError:
        raise BulkProtocolError("ticket is not ASCII") from None
    offset = struct.unpack(">Q", recv_exact(sock, 8))[0] if magic == RESUME_MAGIC else 0
    return token, offset


def read_ticket(sock: socket.socket) -> str:
    return read_hello(sock)[0]


def write_status(sock: socket.socket, status: Status) -> None:
    sock.sendall(status.frame())


def read_status(sock: socket.socket, unstarted: type[Exception] = BulkProtocolError) -> Status:
    (length,) = struct.unpack(">I", recv_exact(sock, 4, unstarted))
    if length > MAX_STATUS:
        raise BulkProtocolError(f"status frame of {length} bytes (at most {MAX_STATUS})")
    try:
        doc = json.loads(recv_exact(sock, length))
        return Status(bool(doc["ok"]), str(doc.get("code", "")), str(doc.get("reason", "")),
                      str(doc.get("message", "")), int(doc.get("offset", 0)))
    except (ValueError, KeyError, TypeError):
        raise BulkProtocolError("malformed status frame") from None


def recv_payload(sock: socket.socket, asm: codec.Assembler | DigestSink, idle_s: float,
                 deadline: float | None = None,
                 on_bytes: Callable[[int], None] | None = None,
                 min_rate: float | None = None, grace_s: float = RATE_GRACE_S) -> None:
    """Read the rest of `asm`'s payload straight into its buffer, hashing as it lands.

    TimeoutError when nothing arrives for `idle_s` or `deadline` (epoch seconds) passes;
    TooSlow (a TimeoutError) when, past `grace_s`, fewer than `min_rate` bytes a second came
    on average; codec.Truncated when the sender closes early (asm.finish() then checks the
    digest).
    """
    started = time.monotonic()
    first = asm.received
    # The inner loop is the hot path: a TLS read returns one 16 KiB record, so a 256 MiB
    # payload takes 16,384 reads, and per-read Python work (a timeout set, a view made, the
    # assembler told) costs as much as the decryption. Each block is filled read after read
    # and handed over once; the timeout is set again only when the deadline is nearer than
    # the idle timeout, and the caller hears of progress every PROGRESS_BYTES.
    sock.settimeout(idle_s)
    timeout = idle_s
    while asm.received < asm.size:
        tail = asm.tail()
        limit = min(len(tail), RECV_BLOCK)
        got = reported = 0
        try:
            while got < limit:
                if deadline is not None:
                    left = deadline - time.time()
                    if left <= 0:
                        raise TimeoutError("the transfer outlived its deadline")
                    if left < timeout or timeout < idle_s:
                        timeout = min(idle_s, left)
                        sock.settimeout(timeout)
                n = sock.recv_into(tail[got:limit])
                if n == 0:
                    break
                got += n
                if min_rate is not None:
                    late = time.monotonic() - started - grace_s
                    if late > 0 and asm.received - first + got < late * min_rate:
                        raise TooSlow(f"the transfer fell below {min_rate:g} bytes/s")
                if on_bytes is not None and got - reported >= PROGRESS_BYTES:
                    on_bytes(got - reported)
                    reported = got
        except BaseException:
            # The connection broke mid-block: what landed is kept (hashed into the running
            # digest), so a resumed transfer continues after it, not from the block's start.
            tail.release()
            if got:
                asm.advance(got)
            raise
        else:
            tail.release()
        if got:
            asm.advance(got)
            if on_bytes is not None and got > reported:
                on_bytes(got - reported)
        if got < limit:
            raise codec.Truncated(f"stream truncated: got {asm.received} of {asm.size} bytes")


def send_payload(sock: socket.socket, source: Path | Sequence[memoryview],
                 offset: int = 0, on_bytes: Callable[[int], None] | None = None) -> None:
    """Send a file (sendfile on a plain socket: no copy through this process) or segments,
    from byte `offset` on (a resumed transfer); `on_bytes(n)` after every PROGRESS_BYTES or
    so handed to the socket (a transfer's progress in the sender's log)."""
    if isinstance(source, Path):
        with open(source, "rb") as fh:
            # socket.sendfile uses os.sendfile where it can and falls back to send on TLS.
            if on_bytes is None:
                sock.sendfile(fh, offset)
                return
            size = os.fstat(fh.fileno()).st_size
            while offset < size:
                n = sock.sendfile(fh, offset, min(PROGRESS_BYTES, size - offset))
                if n <= 0:
                    break
                offset += n
                on_bytes(n)
        return
    for seg in source:
        if offset >= len(seg):
            offset -= len(seg)
            continue
        if on_bytes is None:
            sock.sendall(seg[offset:] if offset else seg)
        else:
            for pos in range(offset, len(seg), PROGRESS_BYTES):
                block = seg[pos : pos + PROGRESS_BYTES]
                sock.sendall(block)
                on_bytes(len(block))
        offset = 0


def first_status(sock: socket.socket, ticket: str, offset: int = 0) -> Status:
    """Send the ticket and read the go-ahead; TurnedAway if the connection ends first."""
    try:
        send_ticket(sock, ticket, offset)
        return read_status(sock, TurnedAway)
    except ConnectionError as exc:
        raise TurnedAway(f"closed before its first status: {exc}") from None


def download(host: str, port: int, tls: TlsFiles | None, ticket: str,
             asm: codec.Assembler | DigestSink, idle_s: float = 60.0,
             on_bytes: Callable[[int], None] | None = None) -> None:
    """Fetch a task's payload into `asm` (the rest of it, when `asm` holds a part already);
    BulkUnreachable (fall back to gRPC), RefusedError (the aggregator said no), TimeoutError,
    OSError or codec errors otherwise."""
    with connect(host, port, tls) as sock:
        sock.settimeout(idle_s)
        # Resumed: from the end of the last verified segment (the bytes held, without them).
        status = first_status(sock, ticket, asm.rewind())
        if not status.ok:
            raise RefusedError(status)
        recv_payload(sock, asm, idle_s, on_bytes=on_bytes)


def upload(host: str, port: int, tls: TlsFiles | None, ticket: str,
           source: Path | Sequence[memoryview], idle_s: float = 60.0,
           verdict_timeout_s: float = VERDICT_TIMEOUT_S,
           on_bytes: Callable[[int], None] | None = None) -> Status:
    """Send an update's payload; the aggregator's verdict (ok or why it was refused).
    `on_bytes(n)` as the payload is handed to the socket (send_payload)."""
    with connect(host, port, tls) as sock:
        # The go-ahead may wait for the aggregator's upload memory (until the round's end).
        sock.settimeout(verdict_timeout_s)
        status = first_status(sock, ticket)
        if not status.ok:
            return status
        sock.settimeout(idle_s)
        send_payload(sock, source, status.offset, on_bytes)
        sock.settimeout(verdict_timeout_s)
        return read_status(sock)


class RefusedError(Exception):
    """The aggregator refused a bulk transfer; `status` says why."""

    def __init__(self, status: Status) -> None:
        super().__init__(f"{status.reason or status.code}: {status.message}")
        self.status = status
