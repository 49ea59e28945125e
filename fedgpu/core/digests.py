"""A payload's digest as the wire names it: TaskHeader and UpdateHeader carry the algorithm
and the hex digest (fields 20-22); a header without an algorithm is the contract before
BLAKE3, whose sha256 is in `payload_sha256`. Both sides go through these two functions."""

from __future__ import annotations

from fedgpu.core.codec import DigestAlgo
from fedgpu.proto import pb

_TO_WIRE = {DigestAlgo.SHA256: pb.DIGEST_ALGORITHM_SHA256,
            DigestAlgo.BLAKE3: pb.DIGEST_ALGORITHM_BLAKE3,
            DigestAlgo.BLAKE3_SEGMENTS: pb.DIGEST_ALGORITHM_BLAKE3_SEGMENTS}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}


class UnknownDigest(ValueError):
    """A header naming a digest algorithm this version does not know."""


def of_header(header: pb.TaskHeader | pb.UpdateHeader) -> tuple[DigestAlgo, str]:
    """(algorithm, hex digest) of the payload a header announces."""
    algo = header.payload_digest_algorithm
    if algo == pb.DIGEST_ALGORITHM_UNSPECIFIED:
        return DigestAlgo.SHA256, header.payload_sha256
    try:
        return _FROM_WIRE[algo], header.payload_digest
    except KeyError:
        raise UnknownDigest(f"unknown payload digest algorithm {algo}") from None


def stamp(header: pb.TaskHeader | pb.UpdateHeader, algo: DigestAlgo, digest: str) -> None:
    """Name the payload's digest in `header`."""
    header.payload_digest_algorithm = _TO_WIRE[algo]
    header.payload_digest = digest
    # The field older receivers read: filled only when it is what they expect.
    header.payload_sha256 = digest if algo is DigestAlgo.SHA256 else ""
