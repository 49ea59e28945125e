"""Shamir secret sharing of 32-byte secrets over the prime field GF(2^521 - 1).

No maintained Python library shares arbitrary bytes over a prime field without pulling in a
second crypto stack (PyCryptodome's Shamir works on 16-byte blocks in GF(2^128)); the
arithmetic is a few lines of Python integers and is tested against the textbook vectors.
The Mersenne prime 2^521 - 1 (the P-521 field) holds any 32-byte secret as one element, so a
share is one field element: 66 bytes, big-endian.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from fedgpu.core.secagg.errors import SecAggError

PRIME = (1 << 521) - 1
SHARE_BYTES = 66
SECRET_BYTES = 32


@dataclass(frozen=True, slots=True)
class Share:
    """The polynomial's value y at x (x is the holder's site index, never 0)."""

    x: int
    y: int

    def y_bytes(self) -> bytes:
        return self.y.to_bytes(SHARE_BYTES, "big")


def split_int(secret: int, threshold: int, xs: Sequence[int], prime: int = PRIME) -> list[Share]:
    """Shares of `secret` at the points `xs`; any `threshold` of them give it back."""
    if not 0 <= secret < prime:
        raise SecAggError("the secret must be an element of the field")
    if len(set(xs)) != len(xs) or any(not 0 < x < prime for x in xs):
        raise SecAggError("share points must be distinct and non-zero")
    if not 1 <= threshold <= len(xs):
        raise SecAggError(f"threshold {threshold} must be between 1 and {len(xs)} shares")
    coeffs = [secret] + [secrets.randbelow(prime) for _ in range(threshold - 1)]
    shares = []
    for x in xs:
        # Horner's rule from the highest coefficient down.
        y = 0
        for c in reversed(coeffs):
            y = (y * x + c) % prime
        shares.append(Share(x, y))
    return shares


def combine_int(shares: Sequence[Share], prime: int = PRIME) -> int:
    """The polynomial at 0 by Lagrange interpolation. With fewer shares than the threshold the
    result is a uniformly random field element, not an error: callers count shares first."""
    xs = [s.x for s in shares]
    if not shares or len(set(xs)) != len(xs) or any(not 0 < x < prime for x in xs):
        raise SecAggError("shares must be non-empty with distinct non-zero points")
    secret = 0
    for j, sj in enumerate(shares):
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * xm % prime
                den = den * (xm - sj.x) % prime
        secret = (secret + sj.y * num * pow(den, -1, prime)) % prime
    return secret


def split(secret: bytes, threshold: int, xs: Sequence[int]) -> list[Share]:
    """Shares of a 32-byte secret."""
    if len(secret) != SECRET_BYTES:
        raise SecAggError(f"a shared secret is {SECRET_BYTES} bytes, got {len(secret)}")
    return split_int(int.from_bytes(secret, "big"), threshold, xs)


def combine(shares: Sequence[Share]) -> bytes:
    """The 32-byte secret behind `shares` (at least the threshold of them)."""
    value = combine_int(shares)
    if value >> (8 * SECRET_BYTES):
        # Fewer shares than the threshold (or a corrupted one) land anywhere in the field.
        raise SecAggError("the shares do not reconstruct a 32-byte secret")
    return value.to_bytes(SECRET_BYTES, "big")


def share_from_bytes(x: int, data: bytes) -> Share:
    if len(data) != SHARE_BYTES:
        raise SecAggError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
    y = int.from_bytes(data, "big")
    if y >= PRIME:
        raise SecAggError("a share is not an element of the field")
    return Share(x, y)
