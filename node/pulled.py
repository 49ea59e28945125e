"""A task as the node pulled it, and what receives its payload: the types the wire client
returns and the errors it raises about a payload (node/wire_client.py)."""

from __future__ import annotations

from dataclasses import dataclass

from fedgpu.core import codec, digests
from fedgpu.core.digest_sink import DigestSink
from fedgpu.proto import pb

# What receives a task's payload: an Assembler (keeps it) or a DigestSink (checks and drops).
Receiver = codec.Assembler | DigestSink


class PayloadError(Exception):
    """A task payload the node cannot use. `header` is the task's, when it arrived: then the
    node reports the task as failed (asking again would bring the same payload); without one
    the stream broke before saying what it carried, and the node asks again."""

    def __init__(self, message: str, header: pb.TaskHeader | None = None) -> None:
        super().__init__(message)
        self.header = header


class PayloadTooLarge(PayloadError):
    """The task announced more bytes than this node takes; nothing of it was read."""


@dataclass
class Pulled:
    """One task as it arrived: its header, its payload (None without one or when the receiver
    keeps nothing), the receiver to release after use, and how the bytes came."""

    header: pb.TaskHeader
    payload: memoryview | None
    receiver: Receiver | None
    transport: str          # "grpc" | "bulk"
    seconds: float          # first byte of the task to the whole payload checked


def default_receiver(header: pb.TaskHeader, max_bytes: int) -> Receiver:
    """An Assembler for the task's payload, checked against the digest its header names."""
    try:
        algo, digest = digests.of_header(header)
    except digests.UnknownDigest as exc:
        raise codec.CodecError(str(exc)) from None
    return codec.Assembler(header.payload_size, digest, max_bytes, algo,
                           segment_digests=header.payload_segment_digests)
