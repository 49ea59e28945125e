"""The node agent's blocking view of the wire client (node/wire_client.py).

The agent is written as threads (its loop, its heartbeats, several agents in one process:
node/fleet.py); the wire client is asyncio. Every client of a process shares one event loop on
a daemon thread of its own, and each call here waits for its coroutine there, so the protocol
lives once, in the wire client, for the agent and `fedgpu sim` alike.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from fedgpu.core import codec, tls_diagnosis
from fedgpu.core.tls import TlsFiles
from fedgpu.node.bulk_client import BulkPath
from fedgpu.node.pulled import PayloadError, PayloadTooLarge
from fedgpu.node.wire_client import WireClient, is_unreachable
from fedgpu.proto import pb

__all__ = ["AggregatorClient", "ClientClosed", "PayloadError", "PayloadTooLarge",
           "is_unreachable"]

T = TypeVar("T")
# How often explain() may probe the aggregator's address while calls keep failing.
EXPLAIN_EVERY_S = 10.0


class ClientClosed(grpc.RpcError):
    """A call ended because the client was closed under it (the agent is stopping); shaped as
    the CANCELLED gRPC error the same call gets from a closed channel."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "the node's client was closed"


class _Loop:
    """The process's event loop for wire clients, started on first use."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="fedgpu-wire",
                                 daemon=True).start()
                cls._loop = loop
            return cls._loop


class AggregatorClient:
    def __init__(self, address: str, token: str | None,
                 chunk_size: int = codec.DEFAULT_CHUNK_SIZE, tls: TlsFiles | None = None):
        self._loop = _Loop.get()
        self._closed = False
        self._tls = tls
        # What explain() said last, and when it last looked (it probes at most so often).
        self._said: str | None = None
        self._looked = -EXPLAIN_EVERY_S

        async def make() -> WireClient:
            # grpc.aio binds a channel to the loop it is made on.
            return WireClient(address, token, tls, chunk_size)

        self._wire = self._wait(make())

    @property
    def address(self) -> str:
        return self._wire.address

    @property
    def bulk(self) -> BulkPath:
        return self._wire.bulk

    @property
    def chunk_size(self) -> int:
        return self._wire.chunk_size

    @chunk_size.setter
    def chunk_size(self, value: int) -> None:
        self._wire.chunk_size = value

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            raise ClientClosed() from None
        except grpc.RpcError as exc:
            if self._closed and exc.code() == grpc.StatusCode.CANCELLED:
                raise ClientClosed() from None
            raise

    def explain(self, exc: BaseException) -> str | None:
        """Why calls fail, when it is not an outage (TLS, a wrong port: a line with the fix
        from fedgpu/core/tls_diagnosis.py); None when there is nothing new to say. Looks at
        most every EXPLAIN_EVERY_S and says each cause once, so a node that waits for its
        aggregator names the cause without repeating it at every retry."""
        now = time.monotonic()
        if not tls_diagnosis.worth_probing(exc) or now - self._looked < EXPLAIN_EVERY_S:
            return None
        self._looked = now
        why = tls_diagnosis.diagnose(self.address, self._tls)
        said, self._said = self._said, str(why) if why is not None else None
        return self._said if self._said != said else None

    def run(self, protocol: Callable[[WireClient], Coroutine[Any, Any, T]]) -> T:
        """A protocol written on the wire client (node/secagg.py), run on its loop; blocks."""
        return self._wait(protocol(self._wire))

    def close(self) -> None:
        """Ends every call in flight (from any thread): a long poll returns at once."""
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(self._wire.close(), self._loop).result(timeout=10)

    def register(self, request: pb.RegisterRequest, timeout: float = 10) -> pb.RegisterReply:
        return self._wait(self._wire.register(request, timeout))

    def heartbeat(self, request: pb.HeartbeatRequest, timeout: float = 10) -> pb.HeartbeatReply:
        return self._wait(self._wire.heartbeat(request, timeout))

    def pull(self, node_id: str, wait_s: int, max_bytes: int, busy: Sequence[str] = ()
             ) -> tuple[pb.TaskHeader, memoryview | None]:
        pulled = self._wait(self._wire.pull(node_id, wait_s, max_bytes, busy=busy))
        return pulled.header, pulled.payload

    def fetch_bundle(self, node_id: str, sha256: str, max_bytes: int, timeout: float = 120
                     ) -> bytes:
        return self._wait(self._wire.fetch_bundle(node_id, sha256, max_bytes, timeout))

    def push(self, header: pb.UpdateHeader, payload: Path | None) -> pb.PushReply:
        reply, _ = self._wait(self._wire.push(header, payload))
        return reply
