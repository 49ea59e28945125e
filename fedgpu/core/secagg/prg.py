"""The mask generator: a 32-byte seed expanded into a vector in Z_2^32 or Z_2^64.

AES-256-CTR keystream from `cryptography` (OpenSSL, AES-NI: several GB/s on one core), written
with `update_into` into one reused buffer, so expanding a mask for an 11M-parameter model never
holds more than one block. Every seed is used once (a fresh self-mask seed per round, pairwise
seeds bound to the round by HKDF), so the all-zero counter block is safe. Masks are consumed
in order, block after block, by the site that adds them and the aggregator that removes them.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedgpu.core.secagg.errors import SecAggError

SEED_BYTES = 32
# 64 Ki elements: 256-512 KiB a block, small enough to stay in cache while the aggregator
# applies every correction to one block of its sum.
BLOCK_ELEMENTS = 1 << 16
_AES_BLOCK = 16


def ring_dtype(ring_bits: int) -> np.dtype:
    if ring_bits == 32:
        return np.dtype("<u4")
    if ring_bits == 64:
        return np.dtype("<u8")
    raise SecAggError(f"the ring is Z_2^32 or Z_2^64, got 2^{ring_bits}")


class Scratch:
    """One block of zeros in and one of keystream out, shared by streams used in turn."""

    def __init__(self, dtype: np.dtype, block: int = BLOCK_ELEMENTS) -> None:
        self.dtype = np.dtype(dtype)
        self.block = block
        self.zeros = bytes(block * self.dtype.itemsize)
        # update_into wants room for one cipher block beyond the input.
        self.out = bytearray(len(self.zeros) + _AES_BLOCK - 1)


class MaskStream:
    """The mask of one seed, read front to back in pieces of up to one block."""

    def __init__(self, seed: bytes, scratch: Scratch) -> None:
        if len(seed) != SEED_BYTES:
            raise SecAggError(f"a mask seed is {SEED_BYTES} bytes, got {len(seed)}")
        self._enc = Cipher(algorithms.AES(seed), modes.CTR(bytes(_AES_BLOCK))).encryptor()
        self._scratch = scratch

    def next(self, count: int) -> np.ndarray:
        """The next `count` mask elements, as a view of the scratch buffer that the following
        call of any stream sharing it overwrites."""
        s = self._scratch
        if count > s.block:
            raise SecAggError(f"at most {s.block} elements per call, asked {count}")
        self._enc.update_into(memoryview(s.zeros)[:count * s.dtype.itemsize], s.out)
        return np.frombuffer(s.out, dtype=s.dtype, count=count)


def apply_masks(vector: np.ndarray, seeds: list[tuple[bytes, int]],
                block: int = BLOCK_ELEMENTS) -> None:
    """Add (sign +1) or subtract (-1) the mask of each seed to `vector` in place, mod 2^bits.

    Block-major: each block of `vector` takes every mask before the next block is touched,
    so memory is the vector, one block of keystream and a cipher state per seed (a few hundred
    bytes), whatever the seed count.
    """
    if vector.ndim != 1 or vector.dtype.kind != "u":
        raise SecAggError("masks apply to a flat vector of unsigned ring elements")
    scratch = Scratch(vector.dtype, block)
    streams = [(MaskStream(seed, scratch), sign) for seed, sign in seeds]
    for start in range(0, vector.size, block):
        part = vector[start:start + block]
        for stream, sign in streams:
            mask = stream.next(part.size)
            if sign > 0:
                np.add(part, mask, out=part)
            else:
                np.subtract(part, mask, out=part)


def expand(seed: bytes, count: int, dtype: np.dtype) -> np.ndarray:
    """The first `count` mask elements of `seed` as a new array (tests, small vectors)."""
    out = np.zeros(count, dtype=dtype)
    apply_masks(out, [(seed, 1)])
    return out
