"""A payload's digest algorithms: what a sender computes and a receiver checks (codec
re-exports these names: callers say codec.DigestAlgo, codec.hasher and so on).

The wire digest is BLAKE3_SEGMENTS (fedgpu/core/segment_hasher.py: BLAKE3 over the BLAKE3
digests of the payload's segments), so a payload's segment digests and its whole
digest come from one pass. Payloads name their algorithm, so "blake3" (plain BLAKE3, the
version before) and sha256 ones (older senders, older checkpoints) stay readable; their
segment digests, where announced, are then checked in a second hash of the same bytes.
"""

from __future__ import annotations

import hashlib
import os
from enum import StrEnum
from typing import TypeGuard

import blake3

from fedgpu.core.codec_errors import DigestMismatch, Truncated
from fedgpu.core.digest_pipe import Hasher, PipelinedDigest
from fedgpu.core.segment_hasher import SegmentHasher, check_root, of_file
from fedgpu.core.segments import SegmentedDigest, checked, segmented


class DigestAlgo(StrEnum):
    SHA256 = "sha256"
    BLAKE3 = "blake3"
    BLAKE3_SEGMENTS = "blake3-segments"


# What this version sends; a receiver takes whichever the payload names.
WIRE_DIGEST = DigestAlgo.BLAKE3_SEGMENTS


def hasher(algo: DigestAlgo, all_cores: bool = False, size: int | None = None) -> Hasher:
    """A fresh digest of `algo`. Plain BLAKE3 on one thread by default: received bytes arrive
    block by block while the other core is busy receiving them; `all_cores` for a payload that
    is all in memory already, which BLAKE3's tree splits across the cores."""
    if algo is DigestAlgo.BLAKE3_SEGMENTS:
        if size is None:  # its segments' size follows from the payload's
            raise ValueError("a BLAKE3_SEGMENTS digest needs the payload's size")
        return SegmentHasher(size)
    if algo is DigestAlgo.BLAKE3:
        return blake3.blake3(max_threads=blake3.blake3.AUTO if all_cores else 1)
    return hashlib.sha256()


def receiving(algo: DigestAlgo, expected: str, segment_digests: bytes, size: int
              ) -> Hasher | SegmentedDigest | SegmentHasher:
    """The digest a receiver feeds a payload's bytes through, at header time: with announced
    segment digests, one that checks each segment as it completes and rewinds to the last
    verified one. BLAKE3_SEGMENTS does it in the one pass its digest needs (and a header whose
    segment digests do not hash to its digest is refused here, before a byte moves); the
    older algorithms hash the bytes twice. SegmentCountError for a wrong number of digests."""
    if algo is DigestAlgo.BLAKE3_SEGMENTS:
        digests = checked(size, segment_digests)
        check_root(digests, expected)
        return SegmentHasher(size, digests)
    return segmented(hasher(algo), segment_digests, size)


def resumable(digest: object) -> TypeGuard[SegmentedDigest | SegmentHasher]:
    """Whether `digest` (from receiving()) knows the last verified segment (has rewind())."""
    return isinstance(digest, (SegmentedDigest, SegmentHasher))


def digest_file(path: str | os.PathLike[str], algo: DigestAlgo) -> str:
    """The digest of a file's bytes (BLAKE3 reads it memory-mapped, on all cores)."""
    return file_digests(path, algo)[0]


def file_digests(path: str | os.PathLike[str], algo: DigestAlgo) -> tuple[str, bytes]:
    """(digest, segment digests to announce) of a file's bytes: one pass for BLAKE3_SEGMENTS;
    b"" for the others (their segment digests cost a pass of their own)."""
    if algo is DigestAlgo.BLAKE3_SEGMENTS:
        return of_file(path)
    if algo is DigestAlgo.BLAKE3:
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        if os.path.getsize(path):
            h.update_mmap(path)
        return h.hexdigest(), b""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest(), b""


def check_whole(received: int, size: int, digest: Hasher, expected: str,
                algorithm: str) -> None:
    """A received payload's last check, on every path that receives one: every byte announced
    came, and they hash to the digest its header named (a pipelined digest is closed)."""
    if received != size:
        raise Truncated(f"stream truncated: got {received} of {size} bytes")
    actual = digest.hexdigest()
    if isinstance(digest, PipelinedDigest):
        digest.close()
    if actual != expected:
        raise DigestMismatch(f"{algorithm} mismatch: payload hashes to {actual}, "
                             f"header says {expected or '(none)'}")
