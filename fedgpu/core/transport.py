"""The one place gRPC servers and channels are configured; every option says why it is set."""

from __future__ import annotations

import grpc

from fedgpu.core.codec import DEFAULT_CHUNK_SIZE
from fedgpu.core.tls import TlsFiles, channel_credentials

# Weights never travel as one message: they stream in chunks (default 1 MiB, at most 16 MiB),
# so a message limit just above the largest chunk keeps any model size working while a
# client can't make the server buffer a multi-GB single message.
MAX_CHUNK_SIZE = 16 << 20
MAX_MESSAGE_BYTES = MAX_CHUNK_SIZE + (1 << 20)
TOKEN_HEADER = "x-fedgpu-token"

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Nodes ping every 30 s to keep NAT/firewall state alive during long polls; without
    # this the server would answer such pings with GOAWAY (too_many_pings).
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # The server probes idle connections so dead nodes free their resources.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    # Many nodes behind one NAT would otherwise hit the default per-connection stream cap
    # when they share a connection through a proxy.
    ("grpc.max_concurrent_streams", 4096),
    # gRPC sets SO_REUSEPORT by default, so a second aggregator on the same port would start
    # and share it (each connection going to either one); without it the bind fails at start.
    ("grpc.so_reuseport", 0),
]

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Keep NAT state alive while a PullTask long-poll is open and detect a dead server fast.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect quickly after an aggregator restart instead of gRPC's default 2 min cap.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 10_000),
]


def channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    """A channel to the aggregator: TLS (and a client certificate) when `tls` is given."""
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, channel_credentials(tls), options=CHANNEL_OPTIONS)


def aio_channel(address: str, tls: TlsFiles | None = None) -> grpc.aio.Channel:
    """The same channel for asyncio callers (node/wire_client.py): same options, same TLS."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=CHANNEL_OPTIONS)


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a port on this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_HEADER, token),) if token else ()


def check_chunk_size(chunk_size: int) -> int:
    if not 4096 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(
            f"chunk size {chunk_size} must be between 4096 and {MAX_CHUNK_SIZE} bytes "
            f"(default {DEFAULT_CHUNK_SIZE})"
        )
    return chunk_size
