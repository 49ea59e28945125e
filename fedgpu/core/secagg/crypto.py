"""Key agreement and share encryption, all from `cryptography`.

Each site makes two X25519 key pairs per round (Bonawitz et al.): `c` keys agree on the AEAD key
that encrypts the Shamir shares one site sends another through the aggregator, `s` keys agree
on the seed of the pairwise mask two neighbours add with opposite signs. Agreed secrets go
through HKDF-SHA256 with the round's context, so keys never repeat across rounds or jobs.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedgpu.core.secagg.errors import SecAggError

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
# Domain separation: one label per use of an agreed secret.
_SHARE_KEY_INFO = b"fedgpu/secagg/v1 share-encryption"
_MASK_SEED_INFO = b"fedgpu/secagg/v1 pairwise-mask"


@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair; `secret` is the raw private key (what Shamir shares of `s` carry)."""

    secret: bytes
    public: bytes
    # Loading a raw key costs as much as an exchange: load it once, agree many times.
    key: X25519PrivateKey = field(repr=False, compare=False)

    @classmethod
    def generate(cls) -> KeyPair:
        sk = X25519PrivateKey.generate()
        return cls(sk.private_bytes_raw(), sk.public_key().public_bytes_raw(), sk)

    @classmethod
    def from_secret(cls, secret: bytes) -> KeyPair:
        sk = _private(secret)
        return cls(secret, sk.public_key().public_bytes_raw(), sk)


def _private(secret: bytes) -> X25519PrivateKey:
    if len(secret) != KEY_BYTES:
        raise SecAggError(f"an X25519 private key is {KEY_BYTES} bytes, got {len(secret)}")
    return X25519PrivateKey.from_private_bytes(secret)


def _agree(mine: KeyPair, peer_public: bytes, info: bytes, context: bytes) -> bytes:
    if len(peer_public) != KEY_BYTES:
        raise SecAggError(f"an X25519 public key is {KEY_BYTES} bytes, got {len(peer_public)}")
    try:
        shared = mine.key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:  # an all-zero (low order) point
        raise SecAggError(f"unusable public key: {exc}") from None
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=context, info=info).derive(shared)


def _pair(a: int, b: int) -> bytes:
    # Both ends derive the same label whatever their order.
    return struct.pack(">II", min(a, b), max(a, b))


def mask_seed(mine: KeyPair, peer_public: bytes, context: bytes, me: int, peer: int) -> bytes:
    """The 32-byte PRG seed of the mask sites `me` and `peer` share (the same at both ends)."""
    return _agree(mine, peer_public, _MASK_SEED_INFO + _pair(me, peer), context)


def share_key(mine: KeyPair, peer_public: bytes, context: bytes, me: int, peer: int) -> bytes:
    """The AEAD key for shares between `me` and `peer`."""
    return _agree(mine, peer_public, _SHARE_KEY_INFO + _pair(me, peer), context)


def _associated(context: bytes, src: int, dst: int) -> bytes:
    # Binding the round and the direction stops the aggregator replaying a ciphertext from
    # another round, or handing u's shares for v to w.
    return context + struct.pack(">II", src, dst)


def seal(key: bytes, plaintext: bytes, context: bytes, src: int, dst: int) -> bytes:
    """nonce || ChaCha20-Poly1305(plaintext); a fresh random nonce per message."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, _associated(context, src, dst))


def open_sealed(key: bytes, sealed: bytes, context: bytes, src: int, dst: int) -> bytes:
    if len(sealed) < NONCE_BYTES + TAG_BYTES:
        raise SecAggError(f"encrypted shares from site {src} are too short")
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:],
                                             _associated(context, src, dst))
    except InvalidTag:
        raise SecAggError(f"encrypted shares from site {src} to site {dst} do not "
                          "authenticate (tampered, or meant for another round)") from None
