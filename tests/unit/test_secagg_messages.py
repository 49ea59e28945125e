"""Secure aggregation's messages: one encoding per message, and decoders that refuse anything
truncated, padded, out of bounds or out of order before allocating for it."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from fedgpu.core.secagg.errors import SecAggError
from fedgpu.core.secagg.messages import (
    SEALED_BYTES,
    KeyRelay,
    MaskedInput,
    PublicKeys,
    RevealedShare,
    Sealed,
    Setup,
    ShareKeys,
    ShareKind,
    ShareRelay,
    UnmaskReply,
    UnmaskRequest,
)
from fedgpu.core.secagg.params import Settings
from fedgpu.core.secagg.shamir import SHARE_BYTES

PARAMS = Settings(neighbours=4).resolve(10, 1000)
KEYS = [PublicKeys(i, bytes([i]) * 32, bytes([i + 100]) * 32) for i in (2, 5, 9)]
SEALED = tuple(Sealed(i, bytes([i]) * SEALED_BYTES) for i in (1, 4))

MESSAGES = [
    Setup(b"c" * 32, 3, b"g" * 32, PARAMS),
    KEYS[0],
    KeyRelay(tuple(KEYS)),
    ShareKeys(7, SEALED),
    ShareRelay(SEALED),
    UnmaskRequest((2, 4), (1, 3, 7)),
    UnmaskReply(3, (RevealedShare(1, ShareKind.SELF_MASK, b"\1" * SHARE_BYTES),
                    RevealedShare(2, ShareKind.MASK_KEY, b"\2" * SHARE_BYTES))),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_and_refuse_damage(msg: object) -> None:
    data = msg.encode()  # type: ignore[attr-defined]
    assert type(msg).decode(data) == msg  # type: ignore[attr-defined]
    with pytest.raises(SecAggError, match="truncated"):
        type(msg).decode(data[:-1])  # type: ignore[attr-defined]
    with pytest.raises(SecAggError, match="trailing"):
        type(msg).decode(data + b"\0")  # type: ignore[attr-defined]
    with pytest.raises(SecAggError, match="not a secure-aggregation"):
        type(msg).decode(b"XYZ" + data[3:])  # type: ignore[attr-defined]


def test_one_message_has_one_encoding() -> None:
    assert KeyRelay(tuple(reversed(KEYS))).encode() == KeyRelay(tuple(KEYS)).encode()
    assert ShareRelay(SEALED[::-1]).encode() == ShareRelay(SEALED).encode()


def test_a_message_of_one_kind_is_not_read_as_another() -> None:
    with pytest.raises(SecAggError, match="not a secure-aggregation share-relay"):
        ShareRelay.decode(ShareKeys(7, SEALED).encode())


def test_counts_are_bounded_before_allocation() -> None:
    huge = b"FSA" + bytes([1, KeyRelay.KIND]) + struct.pack(">I", 2**32 - 1)
    with pytest.raises(SecAggError, match="at most"):
        KeyRelay.decode(huge)
    huge = (b"FSA" + bytes([1, MaskedInput.KIND]) + struct.pack(">IBQ", 1, 64, 2**60)
            + bytes(6))
    with pytest.raises(SecAggError, match="at most"):
        MaskedInput.decode(huge)


def test_lists_out_of_order_or_repeated_are_refused() -> None:
    data = bytearray(UnmaskRequest((2, 4), (1, 3)).encode())
    # Swap the two dropped indices by hand: 4 then 2.
    data[9:13], data[13:17] = struct.pack(">I", 4), struct.pack(">I", 2)
    with pytest.raises(SecAggError, match="twice or out of order"):
        UnmaskRequest.decode(bytes(data))
    # One owner, two kinds of share: the double-masking rule, on the wire already.
    both = UnmaskReply(3, (RevealedShare(1, ShareKind.SELF_MASK, b"\1" * SHARE_BYTES),
                           RevealedShare(1, ShareKind.MASK_KEY, b"\1" * SHARE_BYTES)))
    with pytest.raises(SecAggError, match="twice or out of order"):
        UnmaskReply.decode(both.encode())


def test_site_indices_and_setup_params_are_checked() -> None:
    with pytest.raises(SecAggError, match="outside"):
        PublicKeys.decode(PublicKeys(0, b"a" * 32, b"b" * 32).encode())
    setup = Setup(b"c" * 32, 11, b"g" * 32, PARAMS)  # site 11 of 10
    with pytest.raises(SecAggError, match="site 11 of 10"):
        Setup.decode(setup.encode())
    bad = Setup(b"c" * 32, 1, b"g" * 32, PARAMS.__class__(**{**PARAMS.__dict__, "threshold": 9}))
    with pytest.raises(SecAggError, match="threshold 9"):
        Setup.decode(bad.encode())
    with pytest.raises(SecAggError, match="sealed shares are"):
        ShareRelay((Sealed(1, b"short"),)).encode()


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
def test_masked_input_is_little_endian_and_decoded_without_a_copy(dtype: type) -> None:
    v = np.arange(1000, dtype=dtype) * 2654435761
    data = MaskedInput(4, v).encode()
    back = MaskedInput.decode(bytes(data))
    np.testing.assert_array_equal(back.vector, v)
    assert back.vector.dtype.byteorder in "<="
    assert not back.vector.flags.owndata and not back.vector.flags.writeable
    assert back.vector.flags.aligned  # the head is padded to 24 bytes
    bad = bytearray(data)
    bad[20] = 1
    with pytest.raises(SecAggError, match="padding"):
        MaskedInput.decode(bytes(bad))
    assert data[-v.nbytes:] == v.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    with pytest.raises(SecAggError, match="uint32 or uint64"):
        MaskedInput(4, v.astype(np.int64)).encode()
