"""The protocol's messages, in the order they travel, with their byte encoding.

    aggregator -> site   Setup          round context, the site's index, graph seed, RoundParams
    site -> aggregator   PublicKeys     two X25519 public keys (c: share encryption, s: masks)
    aggregator -> site   KeyRelay       the public keys of its neighbours that advertised
    site -> aggregator   ShareKeys      per neighbour, its Shamir shares of b and s_sk, sealed
    aggregator -> site   ShareRelay     the sealed shares addressed to it
    site -> aggregator   MaskedInput    [w q(x), w] + PRG(b) +- PRG(s_uv) in Z_2^ring_bits
    aggregator -> site   SurvivorView   signed rounds only: every site whose input counts
    site -> aggregator   ViewSignature  signed rounds only: its signature of that set
    aggregator -> site   UnmaskRequest  whose self-mask shares (survivors), whose mask-key
                                        shares (dropped) it wants; never both for one site;
                                        in signed rounds its neighbours' view signatures
    site -> aggregator   UnmaskReply    those shares

Signed rounds (sites with a TLS identity, fedgpu/core/secagg/identity.py): the Setup carries
the round's roster (the site name at each index), PublicKeys a certificate and a signature.

Lists are encoded sorted by site index, so one message has one encoding; decoders check every
count and size against the bounds in `params` before allocating anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from fedgpu.core.secagg.crypto import KEY_BYTES, NONCE_BYTES, TAG_BYTES
from fedgpu.core.secagg.encoding import Reader, Writer
from fedgpu.core.secagg.errors import SecAggError
from fedgpu.core.secagg.identity import MAX_CERT_BYTES, MAX_NAME_BYTES, MAX_SIGNATURE_BYTES
from fedgpu.core.secagg.masked_metrics import SLOTS
from fedgpu.core.secagg.params import MAX_LENGTH, MAX_SITES, RoundParams
from fedgpu.core.secagg.prg import SEED_BYTES, ring_dtype
from fedgpu.core.secagg.shamir import SHARE_BYTES

CONTEXT_BYTES = 32
# src, dst, the share of b, the share of s_sk.
PLAIN_SHARES_BYTES = 8 + 2 * SHARE_BYTES
SEALED_BYTES = NONCE_BYTES + PLAIN_SHARES_BYTES + TAG_BYTES


class ShareKind(StrEnum):
    # A share of b, the seed of the site's self-mask: asked of sites whose input counts.
    SELF_MASK = "self-mask"
    # A share of s_sk, the key behind its pairwise masks: asked of sites that dropped.
    MASK_KEY = "mask-key"


_KIND_CODE = {ShareKind.SELF_MASK: 1, ShareKind.MASK_KEY: 2}
_CODE_KIND = {v: k for k, v in _KIND_CODE.items()}


def _index(v: int, what: str = "site index") -> int:
    if not 1 <= v <= MAX_SITES:
        raise SecAggError(f"{what} {v} is outside 1..{MAX_SITES}")
    return v


def _ascending(items: list[int], name: str) -> None:
    if any(a >= b for a, b in zip(items, items[1:], strict=False)):
        raise SecAggError(f"{name} message lists a site twice or out of order")


@dataclass(frozen=True)
class Setup:
    KIND = 1
    context: bytes
    index: int
    graph_seed: bytes
    params: RoundParams
    # The site name at each index 1..n (the names the aggregator registered them under):
    # what a signed neighbour's certificate must say. Empty: not given.
    roster: tuple[str, ...] = ()

    def encode(self) -> bytes:
        p = self.params
        w = (Writer(self.KIND).raw(self.context).u32(self.index).raw(self.graph_seed)
             .u32(p.n_sites).u32(p.degree).u32(p.threshold).f64(p.clip).u8(p.bits)
             .u8(p.ring_bits).u64(p.max_weight).u8(int(p.stochastic)).u64(p.length)
             .u32(p.metrics).u32(len(self.roster)))
        for name in self.roster:
            _put_blob(w, name.encode())
        return w.done()

    @classmethod
    def decode(cls, data: bytes) -> Setup:
        r = Reader(data, cls.KIND, "setup")
        context, index, seed = r.raw(CONTEXT_BYTES), r.u32(), r.raw(SEED_BYTES)
        params = RoundParams(n_sites=r.u32(), degree=r.u32(), threshold=r.u32(), clip=r.f64(),
                             bits=r.u8(), ring_bits=r.u8(), max_weight=r.u64(),
                             stochastic=bool(r.u8()), length=r.u64(), metrics=r.u32())
        params.check()
        count = r.count(params.n_sites, "roster names")
        roster = tuple(_get_blob(r, MAX_NAME_BYTES, "a roster name").decode("utf-8", "replace")
                       for _ in range(count))
        r.end()
        if roster and (len(roster) != params.n_sites or len(set(roster)) != len(roster)):
            raise SecAggError("setup's roster must name every site once")
        if not 1 <= index <= params.n_sites:
            raise SecAggError(f"setup names site {index} of {params.n_sites}")
        return cls(context, index, seed, params, roster)


def _put_blob(w: Writer, data: bytes) -> None:
    w.u32(len(data)).raw(data)


def _get_blob(r: Reader, bound: int, what: str) -> bytes:
    n = r.u32()
    if n > bound:
        raise SecAggError(f"{what} of {n} bytes, at most {bound}")
    return r.raw(n)


@dataclass(frozen=True)
class PublicKeys:
    KIND = 2
    index: int
    c_public: bytes
    s_public: bytes
    # Signed rounds: the site's certificate (DER) and its signature of
    # identity.keys_statement(context, index, c_public, s_public). Empty: unsigned.
    cert: bytes = field(default=b"", repr=False)
    signature: bytes = field(default=b"", repr=False)

    def _put(self, w: Writer) -> Writer:
        w.u32(self.index).raw(self.c_public).raw(self.s_public)
        _put_blob(w, self.cert)
        _put_blob(w, self.signature)
        return w

    @classmethod
    def _get(cls, r: Reader) -> PublicKeys:
        return cls(_index(r.u32()), r.raw(KEY_BYTES), r.raw(KEY_BYTES),
                   _get_blob(r, MAX_CERT_BYTES, "a certificate"),
                   _get_blob(r, MAX_SIGNATURE_BYTES, "a signature"))

    def encode(self) -> bytes:
        return self._put(Writer(self.KIND)).done()

    @classmethod
    def decode(cls, data: bytes) -> PublicKeys:
        r = Reader(data, cls.KIND, "public-keys")
        msg = cls._get(r)
        r.end()
        return msg


@dataclass(frozen=True)
class KeyRelay:
    KIND = 3
    peers: tuple[PublicKeys, ...]

    def encode(self) -> bytes:
        w = Writer(self.KIND).u32(len(self.peers))
        for p in sorted(self.peers, key=lambda p: p.index):
            p._put(w)
        return w.done()

    @classmethod
    def decode(cls, data: bytes) -> KeyRelay:
        r = Reader(data, cls.KIND, "key-relay")
        peers = tuple(PublicKeys._get(r) for _ in range(r.count(MAX_SITES, "sites")))
        r.end()
        _ascending([p.index for p in peers], "key-relay")
        return cls(peers)


@dataclass(frozen=True)
class Sealed:
    """Encrypted shares; `peer` is the recipient in ShareKeys, the sender in ShareRelay."""

    peer: int
    data: bytes


def _put_sealed(w: Writer, items: tuple[Sealed, ...]) -> None:
    w.u32(len(items))
    for s in sorted(items, key=lambda s: s.peer):
        if len(s.data) != SEALED_BYTES:
            raise SecAggError(f"sealed shares are {SEALED_BYTES} bytes, got {len(s.data)}")
        w.u32(s.peer).raw(s.data)


def _get_sealed(r: Reader, name: str) -> tuple[Sealed, ...]:
    items = tuple(Sealed(_index(r.u32()), r.raw(SEALED_BYTES))
                  for _ in range(r.count(MAX_SITES, "sealed shares")))
    _ascending([s.peer for s in items], name)
    return items


@dataclass(frozen=True)
class ShareKeys:
    KIND = 4
    index: int
    sealed: tuple[Sealed, ...]

    def encode(self) -> bytes:
        w = Writer(self.KIND).u32(self.index)
        _put_sealed(w, self.sealed)
        return w.done()

    @classmethod
    def decode(cls, data: bytes) -> ShareKeys:
        r = Reader(data, cls.KIND, "share-keys")
        index = _index(r.u32())
        sealed = _get_sealed(r, "share-keys")
        r.end()
        return cls(index, sealed)


@dataclass(frozen=True)
class ShareRelay:
    KIND = 5
    sealed: tuple[Sealed, ...]

    def encode(self) -> bytes:
        w = Writer(self.KIND)
        _put_sealed(w, self.sealed)
        return w.done()

    @classmethod
    def decode(cls, data: bytes) -> ShareRelay:
        r = Reader(data, cls.KIND, "share-relay")
        sealed = _get_sealed(r, "share-relay")
        r.end()
        return cls(sealed)


# Zero bytes after the masked input's 18-byte head, so its vector starts 8-byte aligned.
_VECTOR_PAD = 6


@dataclass(frozen=True, eq=False)
class MaskedInput:
    KIND = 6
    index: int
    # Z_2^ring_bits elements: the update's values, the weight, the metrics, all masked.
    vector: np.ndarray = field(repr=False)

    def encode(self) -> bytearray:
        v = self.vector
        if v.ndim != 1 or v.dtype.kind != "u" or v.dtype.itemsize not in (4, 8):
            raise SecAggError("a masked input is a flat vector of uint32 or uint64")
        head = (Writer(self.KIND).u32(self.index).u8(8 * v.dtype.itemsize).u64(v.size)
                .raw(bytes(_VECTOR_PAD)).done())
        # One copy of a model-sized vector, straight into the message.
        out = bytearray(len(head) + v.nbytes)
        out[:len(head)] = head
        np.frombuffer(out, dtype=v.dtype.newbyteorder("<"), offset=len(head))[:] = v
        return out

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> MaskedInput:
        """The vector is a view of `data` (read-only for bytes): no copy of a model-sized
        payload."""
        r = Reader(data, cls.KIND, "masked-input")
        index, dtype = _index(r.u32()), ring_dtype(r.u8())
        n = r.u64()
        if n > MAX_LENGTH + 1 + SLOTS:
            raise SecAggError(f"masked-input message has {n} values, at most "
                              f"{MAX_LENGTH + 1 + SLOTS}")
        if any(r.take(_VECTOR_PAD)):
            raise SecAggError("masked-input message has non-zero padding")
        vector = np.frombuffer(r.take(n * dtype.itemsize), dtype=dtype)
        r.end()
        return cls(index, vector)


@dataclass(frozen=True)
class UnmaskRequest:
    KIND = 7
    # Dropped after sharing: the site's mask-key share of each is wanted.
    dropped: tuple[int, ...]
    # Whose masked input counts (the recipient among them): self-mask shares wanted.
    survivors: tuple[int, ...]
    # Signed rounds: the neighbours' signatures of the survivor set (the consistency check).
    signatures: tuple[ViewSignature, ...] = ()

    def encode(self) -> bytes:
        w = Writer(self.KIND)
        for group in (self.dropped, self.survivors):
            w.u32(len(group))
            for i in sorted(group):
                w.u32(i)
        w.u32(len(self.signatures))
        for sig in sorted(self.signatures, key=lambda s: s.index):
            w.u32(sig.index)
            _put_blob(w, sig.signature)
        return w.done()

    @classmethod
    def decode(cls, data: bytes) -> UnmaskRequest:
        r = Reader(data, cls.KIND, "unmask-request")
        groups = []
        for what in ("dropped", "surviving"):
            group = [_index(r.u32()) for _ in range(r.count(MAX_SITES, f"{what} sites"))]
            _ascending(group, "unmask-request")
            groups.append(tuple(group))
        sigs = tuple(ViewSignature(_index(r.u32()),
                                   _get_blob(r, MAX_SIGNATURE_BYTES, "a signature"))
                     for _ in range(r.count(MAX_SITES, "signatures")))
        r.end()
        _ascending([s.index for s in sigs], "unmask-request")
        return cls(groups[0], groups[1], sigs)


@dataclass(frozen=True)
class SurvivorView:
    """Signed rounds: every site whose masked input counts, as the aggregator shows it to
    each survivor before unmasking (Bonawitz et al.'s consistency check)."""

    KIND = 9
    survivors: tuple[int, ...]

    def encode(self) -> bytes:
        w = Writer(self.KIND).u32(len(self.survivors))
        for i in sorted(self.survivors):
            w.u32(i)
        return w.done()

    @classmethod
    def decode(cls, data: bytes) -> SurvivorView:
        r = Reader(data, cls.KIND, "survivor-view")
        group = [_index(r.u32()) for _ in range(r.count(MAX_SITES, "surviving sites"))]
        r.end()
        _ascending(group, "survivor-view")
        return cls(tuple(group))


@dataclass(frozen=True)
class ViewSignature:
    """A site's signature of the survivor set it was shown."""

    KIND = 10
    index: int
    signature: bytes = field(repr=False)

    def encode(self) -> bytes:
        w = Writer(self.KIND).u32(self.index)
        _put_blob(w, self.signature)
        return w.done()

    @classmethod
    def decode(cls, data: bytes) -> ViewSignature:
        r = Reader(data, cls.KIND, "view-signature")
        msg = cls(_index(r.u32()), _get_blob(r, MAX_SIGNATURE_BYTES, "a signature"))
        r.end()
        return msg


@dataclass(frozen=True)
class RevealedShare:
    owner: int
    kind: ShareKind
    y: bytes


@dataclass(frozen=True)
class UnmaskReply:
    KIND = 8
    index: int
    shares: tuple[RevealedShare, ...]

    def encode(self) -> bytes:
        w = Writer(self.KIND).u32(self.index).u32(len(self.shares))
        for s in sorted(self.shares, key=lambda s: (s.owner, _KIND_CODE[s.kind])):
            w.u32(s.owner).u8(_KIND_CODE[s.kind]).raw(s.y)
        return w.done()

    @classmethod
    def decode(cls, data: bytes) -> UnmaskReply:
        r = Reader(data, cls.KIND, "unmask-reply")
        index = _index(r.u32())
        shares = []
        for _ in range(r.count(2 * MAX_SITES, "shares")):
            owner, code = _index(r.u32()), r.u8()
            if code not in _CODE_KIND:
                raise SecAggError(f"unmask-reply message has unknown share kind {code}")
            shares.append(RevealedShare(owner, _CODE_KIND[code], r.raw(SHARE_BYTES)))
        r.end()
        _ascending([s.owner for s in shares], "unmask-reply")
        return cls(index, tuple(shares))
