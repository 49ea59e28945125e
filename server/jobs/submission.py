"""What follows a SubmitJob header on the wire: the task bundle's bytes, then the initial
weights' bytes, each announced (size and sha256) in the header and bounded before a byte of
it is kept: a bundle by MAX_BUNDLE_BYTES (held in memory, checked in a thread), initial
weights by the aggregator's update limit (written to a temporary file as they come, so a
multi-GB model never sits in memory, then checked as safetensors in a thread).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fedgpu.core.bulk import MIN_RATE_BPS
from fedgpu.core.bundles import MAX_BUNDLE_BYTES, Bundle, BundleError, check_sha256, open_archive
from fedgpu.core.errors import ConfigError
from fedgpu.proto import admin_pb2
from fedgpu.server.jobs import initial_weights as iw

# A submission silent this long is cut off, and so is one slower than MIN_RATE_BPS on average
# after the grace period: a trickling upload would hold a temporary file (and a slot of the
# cap on submissions in flight) for hours.
IDLE_S = 60.0
RATE_GRACE_S = 10.0


class SubmissionError(ConfigError):
    """The bytes after the header are not what the header announced, or came too slowly."""


@dataclass
class Received:
    bundle: Bundle | None
    # A temporary file (the caller moves it into the job's directory, or removes it).
    weights: Path | None


async def _chunks(stream: AsyncIterator[admin_pb2.SubmitJobChunk], idle_s: float,
                  min_rate_bps: float, grace_s: float
                  ) -> AsyncIterator[admin_pb2.SubmitJobChunk]:
    """The stream's chunks, cut off when silent for `idle_s` or slower than `min_rate_bps`
    on average after `grace_s`."""
    it = aiter(stream)
    started = time.monotonic()
    got = 0
    while True:
        try:
            msg = await asyncio.wait_for(anext(it), idle_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise SubmissionError(f"no data for {idle_s:g} s: the submission stalled") from None
        got += len(msg.data)
        elapsed = time.monotonic() - started
        if elapsed > grace_s and got < min_rate_bps * elapsed:
            raise SubmissionError(f"{got} bytes in {elapsed:.0f} s: slower than the "
                                  f"{min_rate_bps / 1024:g} KiB/s a submission must keep")
        yield msg


async def receive(head: admin_pb2.SubmitJobHeader,
                  stream: AsyncIterator[admin_pb2.SubmitJobChunk], state_dir: Path,
                  max_weights: int, idle_s: float = IDLE_S,
                  min_rate_bps: float = MIN_RATE_BPS,
                  rate_grace_s: float = RATE_GRACE_S) -> Received:
    """Read the rest of a submission. BundleError about the bundle, SubmissionError
    (ConfigError) about the weights or the framing; nothing is left on disk on error."""
    if not 0 <= head.bundle_size <= MAX_BUNDLE_BYTES:
        raise BundleError(f"{head.bundle_size} bytes announced; the limit is "
                          f"{MAX_BUNDLE_BYTES} bytes")
    if not 0 <= head.initial_weights_size <= max_weights:
        raise iw.WeightsTooLarge(
            f"initial weights of {head.initial_weights_size} bytes announced; this "
            f"aggregator's limit is {max_weights} bytes (--max-update-mib)")
    bundle_sha = (check_sha256(head.bundle_sha256, "bundle_sha256")
                  if head.bundle_size else None)
    weights_sha = (_sha256(head.initial_weights_sha256) if head.initial_weights_size
                   else None)
    bundle_bytes = bytearray()
    weights_path = iw.incoming_path(state_dir) if head.initial_weights_size else None
    fh: BinaryIO | None = open(weights_path, "wb") if weights_path else None  # noqa: SIM115
    digest = hashlib.sha256()
    got = 0
    try:
        async for msg in _chunks(stream, idle_s, min_rate_bps, rate_grace_s):
            data = memoryview(msg.data)
            take = min(len(data), head.bundle_size - len(bundle_bytes))
            if take > 0:
                bundle_bytes += data[:take]
                data = data[take:]
            if not data:
                continue
            got += len(data)
            if fh is None or got > head.initial_weights_size:
                raise SubmissionError("more bytes arrived than the header announced (a "
                                      f"{head.bundle_size}-byte bundle and "
                                      f"{head.initial_weights_size} bytes of initial weights)")
            digest.update(data)
            await asyncio.to_thread(fh.write, data)
        if len(bundle_bytes) != head.bundle_size:
            raise BundleError(f"{len(bundle_bytes)} of the {head.bundle_size} bytes announced "
                              "arrived")
        if got != head.initial_weights_size:
            raise SubmissionError(f"{got} of the {head.initial_weights_size} bytes of initial "
                                  "weights announced arrived")
        if fh is not None:
            await asyncio.to_thread(_close, fh)
            fh = None
            if digest.hexdigest() != weights_sha:
                raise SubmissionError("the initial weights do not match their sha256")
            assert weights_path is not None
            await asyncio.to_thread(iw.check, weights_path, "initial_weights (uploaded)")
        # Parsing, the canonical-form check and the entry's check are CPU work.
        bundle = (await asyncio.to_thread(open_archive, bytes(bundle_bytes), bundle_sha)
                  if head.bundle_size else None)
    except BaseException:
        if fh is not None:
            fh.close()
        if weights_path is not None:
            weights_path.unlink(missing_ok=True)
        raise
    return Received(bundle, weights_path)


def _close(fh: BinaryIO) -> None:
    fh.flush()
    os.fsync(fh.fileno())
    fh.close()


def _sha256(text: str) -> str:
    value = text.strip().lower()
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise SubmissionError(f"initial_weights_sha256 must be 64 hexadecimal characters, got "
                              f"{text[:80]!r}")
    return value
