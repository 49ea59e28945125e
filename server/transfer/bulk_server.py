"""The aggregator's bulk port: task payloads out and update payloads in over plain TCP (TLS or
mutual TLS when the gRPC port has it), beside the gRPC control plane that hands out the
tickets (fedgpu.core.bulk has the conversation, server/transfer/tickets.py the tickets).

Blocking socket calls run on a thread pool of this port's own, bounded like its connections:
a stalled bulk connection waits out its timeout on one of these threads and never holds up
the threads the event loop gives decoding, validation and aggregation. Everything that
touches the round engine runs on the event loop, as for gRPC calls.

Resume: a ticket presented while an older connection of it is still open (the node saw a
reset that never reached this side) lets it read what already waits for it (drain.py), shuts
it down and waits for it to end before going on: the new one takes over the transfer, so the
node's own retry is never refused as a duplicate of itself. A broken upload's bytes are
parked in server/transfer/uploads.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar

from cryptography import x509
from cryptography.x509.oid import NameOID

from fedgpu.core import bulk
from fedgpu.core.bulk import Direction, Status
from fedgpu.proto import pb
from fedgpu.server.rejections import STATUS_OF, UpdateRejected
from fedgpu.server.transfer.bulk_gate import PreTicketGate, Watchdog
from fedgpu.server.transfer.downloads import Downloads
from fedgpu.server.transfer.drain import drained
from fedgpu.server.transfer.payload import ModelPayload
from fedgpu.server.transfer.tickets import Ticket, TicketBook, TicketRefusal, TicketRefused
from fedgpu.server.transfer.uploads import Received, Uploads

log = logging.getLogger("fedgpu.server.bulk")

MAX_CONNECTIONS = 64
# From accepting a connection to holding its ticket (TLS handshake included): a deadline,
# not a per-read timeout (server/transfer/bulk_gate.py).
HANDSHAKE_S = 10.0
# How long a resumed connection waits for the older connection of its ticket to wind down.
TAKEOVER_S = 10.0

T = TypeVar("T")

# How the bulk port hands an upload's payload over: read from the connection by the round's
# deadline (the argument).
ReceiveBy = Callable[[float], AbstractAsyncContextManager[Received]]


class UpdateDesk(Protocol):
    """All the bulk port asks of the aggregator (server/federation_service.py answers): the
    port moves bytes and knows nothing of rounds, jobs or the gRPC service."""

    def open_payload(self, node_id: str, task_id: str) -> ModelPayload | None:
        """The model payload of `node_id`'s open task `task_id`; None when that task is no
        longer open (or carries no model)."""

    def downloaded(self, node_id: str) -> None:
        """`node_id` received its task's payload over this port."""

    async def take_update(self, node_id: str, header: pb.UpdateHeader,
                          receive: ReceiveBy, abort: Callable[[], None] | None = None,
                          told: Callable[[str], None] | None = None) -> str:
        """Take the update `header` announces, its payload read by `receive`; the reply's
        message. A refusal is counted and raised as UpdateRejected. `abort` ends this
        connection's transfer (when the same node's retry takes its place); `told(message)`
        as soon as the update is certain to count, which may be before this returns."""


def peer_names(sock: ssl.SSLSocket) -> frozenset[str]:
    """What the client certificate vouches for: its CN and SANs, as gRPC's auth context has
    them (server/auth.py binds node names to these)."""
    der = sock.getpeercert(binary_form=True)
    if not der:
        return frozenset()
    cert = x509.load_der_x509_certificate(der)
    names = {str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)}
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names.update(str(v) for v in san.get_values_for_type(x509.DNSName))
        names.update(str(v) for v in san.get_values_for_type(x509.IPAddress))
    except x509.ExtensionNotFound:
        pass
    return frozenset(names)


class BulkServer:
    def __init__(self, desk: UpdateDesk, uploads: Uploads, tickets: TicketBook, host: str,
                 port: int, tls: ssl.SSLContext | None = None, mutual: bool = False,
                 max_connections: int = MAX_CONNECTIONS,
                 gate: PreTicketGate | None = None,
                 downloads: Downloads | None = None) -> None:
        self.desk = desk
        # Bytes sent of each download, counted per block (`fedgpu rounds`' progress).
        self.counted = downloads or Downloads()
        self.upload_limits = uploads
        self.tickets = tickets
        self.host, self.port = host, port
        self.tls, self.mutual = tls, mutual
        self.max_connections = max_connections
        self.handshake_s = min(HANDSHAKE_S, uploads.idle_s)
        self.downloads = 0
        self.uploads = 0
        self.bytes_sent = 0
        self._pool = ThreadPoolExecutor(max_connections, thread_name_prefix="bulk")
        # Connections before their ticket: limited per address, on threads of their own, so
        # strangers never hold the transfer slots or their threads.
        self.gate = gate or PreTicketGate()
        self._handshakes = ThreadPoolExecutor(self.gate.total, thread_name_prefix="bulk-hs")
        self.transfers = 0
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        # Open connections' sockets: shut down at close, so that a thread blocked reading one
        # returns at once instead of at its timeout (and the process can exit).
        self._socks: set[socket.socket] = set()
        # The connection now serving each presented ticket: its shadow socket and task.
        self._holders: dict[str, tuple[socket.socket, asyncio.Task[None]]] = {}
        self.resumed = 0

    async def start(self) -> int:
        """Listen; the port bound (the one asked for, or a free one for 0)."""
        try:
            sock = socket.create_server((self.host, self.port), backlog=128)
        except OSError as exc:
            raise OSError(f"cannot listen on the bulk port {self.host}:{self.port}: "
                          f"{exc.strerror or exc}; is the port in use?") from None
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept())
        return self.port

    async def close(self) -> None:
        for s in list(self._socks):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for task in (self._accepting, *self._conns):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._accepting, *self._conns) if t),
                             return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._handshakes.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, Any]:
        """The `bulk` object of `fedgpu status --json`."""
        return {
            "port": self.port,
            "tls": "mutual" if self.mutual else "tls" if self.tls is not None else "none",
            "connections": len(self._conns),
            "unticketed": self.gate.pending,
            "downloads": self.downloads,
            "uploads": self.uploads,
            "bytes_sent": self.bytes_sent,
            "tickets_outstanding": self.tickets.outstanding,
            "tickets_resumable": self.tickets.resumable,
            "resumed": self.resumed,
            "refused": dict(self.tickets.refused),
        }

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, peer = await loop.sock_accept(self._sock)
            refusal = self.gate.admit(peer[0])
            if refusal is not None:
                self.tickets.refuse(TicketRefusal.BUSY, refusal)
                # Debug only: a flood must not flood the log too (the counter shows it).
                log.debug("refused a bulk connection from %s: %s", peer, refusal)
                conn.close()
                continue
            task = asyncio.create_task(self._serve(conn, peer[0], f"{peer[0]}:{peer[1]}"))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    def _handshake(self, conn: socket.socket
                   ) -> tuple[socket.socket, tuple[str, int], frozenset[str] | None]:
        sock: socket.socket = conn
        if self.tls is not None:
            sock = self.tls.wrap_socket(conn, server_side=True)
        hello = bulk.read_hello(sock)
        names = peer_names(sock) if self.mutual and isinstance(sock, ssl.SSLSocket) else None
        return sock, hello, names

    async def _serve(self, conn: socket.socket, address: str, peer: str) -> None:
        conn.setblocking(True)
        conn.settimeout(self.handshake_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = conn
        # A second descriptor of the same socket: TLS takes `conn` over, and the watchdogs
        # and close() must still be able to shut it down.
        shadow = socket.fromfd(conn.fileno(), conn.family, conn.type)
        self._socks.add(shadow)
        try:
            got = await self._pre_ticket(conn, shadow, address, peer)
            if got is None:
                return
            sock, (token, offset), names = got
            if self.transfers >= self.max_connections:
                self.tickets.refuse(TicketRefusal.BUSY, "too many bulk transfers")
                log.warning("refused a bulk connection from %s: %d transfers already run",
                            peer, self.transfers)
                return
            self.transfers += 1
            try:
                await self._transfer(sock, shadow, token, offset, names, peer)
            finally:
                self.transfers -= 1
        except OSError as exc:
            log.info("bulk connection from %s broke off: %s", peer, exc)
        finally:
            self._socks.discard(shadow)
            shadow.close()
            sock.close()

    async def _pre_ticket(self, conn: socket.socket, shadow: socket.socket, address: str,
                          peer: str
                          ) -> tuple[socket.socket, tuple[str, int], frozenset[str] | None] | None:
        """The TLS handshake and the ticket, by the deadline; None when refused."""
        dog = Watchdog(shadow, self.handshake_s)
        try:
            got = await asyncio.get_running_loop().run_in_executor(
                self._handshakes, self._handshake, conn)
        except (bulk.BulkProtocolError, OSError, ssl.SSLError) as exc:
            if dog.expired or isinstance(exc, TimeoutError):
                self.tickets.refuse(TicketRefusal.HANDSHAKE, "no ticket in time")
                log.warning("dropped a bulk connection from %s: no ticket within %gs of "
                            "connecting", peer, self.handshake_s)
            elif isinstance(exc, bulk.ClosedQuietly):
                log.debug("bulk port probed from %s", peer)
            elif isinstance(exc, bulk.BulkProtocolError):
                self.tickets.refuse(TicketRefusal.MALFORMED, str(exc))
                log.warning("refused a bulk connection from %s: %s", peer, exc)
            else:
                # A failed TLS handshake.
                self.tickets.refuse(TicketRefusal.HANDSHAKE, str(exc))
                log.warning("dropped a bulk connection from %s: %s", peer, exc)
            return None
        finally:
            dog.cancel()
            self.gate.release(address)
        if dog.expired:  # the ticket came as the deadline passed: the socket is shut
            self.tickets.refuse(TicketRefusal.HANDSHAKE, "no ticket in time")
            got[0].close()
            return None
        return got

    async def _transfer(self, sock: socket.socket, shadow: socket.socket, token: str,
                        offset: int, names: frozenset[str] | None, peer: str) -> None:
        try:
            ticket = self.tickets.redeem(token, names, offset)
        except TicketRefused as exc:
            log.warning("refused a bulk connection from %s: %s", peer, exc.message)
            await self._blocking(bulk.write_status, sock, Status(
                False, "PERMISSION_DENIED", exc.reason, exc.message))
            return
        await self._take_over(token)
        me = asyncio.current_task()
        assert me is not None
        self._holders[token] = (shadow, me)
        done = False
        try:
            if ticket.direction is Direction.DOWNLOAD:
                await self._download(sock, shadow, ticket, offset)
            else:
                await self._upload(sock, shadow, ticket)
            done = True
        finally:
            if self._holders.get(token, (None, None))[1] is me:
                del self._holders[token]
                # A verdict spends the ticket; a break leaves it to be presented again, and so
                # does a download sent whole (its node may not have got the last bytes).
                if done and ticket.direction is Direction.DOWNLOAD:
                    self.tickets.sent(token)
                elif done:
                    self.tickets.finished(token)
                else:
                    self.tickets.broke(token)

    async def _take_over(self, token: str) -> None:
        """End the older connection still serving `token` (its node has given up on it)."""
        held = self._holders.get(token)
        if held is None:
            return
        self.resumed += 1
        shadow, task = held
        # What it has not read yet would be sent again (server/transfer/drain.py).
        await drained(shadow, task)
        with contextlib.suppress(OSError):
            shadow.shutdown(socket.SHUT_RDWR)
        await asyncio.wait({task}, timeout=TAKEOVER_S)

    async def _download(self, sock: socket.socket, shadow: socket.socket,
                        ticket: Ticket, offset: int) -> None:
        payload = self.desk.open_payload(ticket.node_id, ticket.task_id)
        if payload is None or payload.size != ticket.size:
            await self._blocking(bulk.write_status, sock, Status(
                False, "FAILED_PRECONDITION", "stale",
                "the task this ticket was issued for is no longer open: ask for work again"))
            return
        if not 0 <= offset <= payload.size:
            await self._blocking(bulk.write_status, sock, Status(
                False, "INVALID_ARGUMENT", "malformed",
                f"resume offset {offset} is past the payload's {payload.size} bytes"))
            return
        if offset:
            self.resumed += 1
        await self._blocking(bulk.write_status, sock, Status(True, offset=offset))
        sock.settimeout(self.upload_limits.idle_s)
        # A reader slower than the minimum rate is cut off: it would hold a slot for hours.
        dog = Watchdog(shadow, bulk.RATE_GRACE_S + payload.size / bulk.MIN_RATE_BPS)
        try:
            with self.counted.track(ticket.node_name, payload.size, offset) as sent:
                await self._blocking(payload.send, sock, offset, sent.add)
        except OSError:
            if dog.expired:
                raise OSError(f"the download fell below {bulk.MIN_RATE_BPS} bytes/s") \
                    from None
            raise
        finally:
            dog.cancel()
        self.downloads += 1
        self.bytes_sent += payload.size - offset
        self.desk.downloaded(ticket.node_id)

    async def _upload(self, sock: socket.socket, shadow: socket.socket, ticket: Ticket) -> None:
        header = ticket.header
        assert header is not None

        @contextlib.asynccontextmanager
        async def receive(deadline: float) -> AsyncIterator[Received]:
            async with self.upload_limits.receive_socket(ticket.node_name, header, sock,
                                                         deadline, self._blocking,
                                                         ticket.token) as got:
                yield got

        def abort() -> None:
            with contextlib.suppress(OSError):
                shadow.shutdown(socket.SHUT_RDWR)

        # The verdict goes out as soon as it is certain (the update is in a fold that cannot
        # refuse it): the node's upload ends there, not after the sum is written.
        early: list[asyncio.Future[None]] = []

        def told(message: str) -> None:
            if not early:
                early.append(asyncio.ensure_future(self._blocking(
                    bulk.write_status, sock, Status(True, "OK", "", message))))

        try:
            message = await self.desk.take_update(ticket.node_id, header, receive, abort, told)
        except UpdateRejected as exc:
            if early:  # the fold failed after all (out of memory): the log says so
                log.error("update from %s refused after its verdict went out: %s",
                          ticket.node_name, exc.message)
                return
            await self._verdict(sock, exc)
            return
        finally:
            if early:
                # Written before the connection is closed; a sender gone meanwhile is its
                # own loss (it resumes, and is told it was accepted already).
                await asyncio.wait(early)
                if not early[0].cancelled():
                    early[0].exception()
        self.uploads += 1
        if not early:
            await self._blocking(bulk.write_status, sock, Status(True, "OK", "", message))

    async def _verdict(self, sock: socket.socket, exc: UpdateRejected) -> None:
        code = STATUS_OF.get(exc.reason)
        with contextlib.suppress(OSError):
            await self._blocking(bulk.write_status, sock, Status(
                False, code.name if code is not None else "INVALID_ARGUMENT", exc.reason,
                f"update rejected ({exc.reason}): {exc.message}"))
