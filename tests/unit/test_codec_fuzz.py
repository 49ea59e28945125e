"""The wire codec under hypothesis: any chunking reassembles exactly; any truncation or bit flip
is refused; and no byte string, however forged, makes decoding fail with anything but
CodecError (which the aggregator turns into a refusal instead of a crash)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedgpu.core import codec
from fedgpu.server.rejections import UpdateRejected
from fedgpu.server.rounds.validation import decode_and_check

DTYPES = [np.dtype(n) for n in ("<f4", "<f2", "<f8", "<i8", "<i4", "u1", "?")]

tensor_sets = st.dictionaries(
    st.text(st.characters(codec=("ascii"), categories=("L", "N")), min_size=1, max_size=8),
    st.sampled_from(DTYPES).flatmap(lambda dt: hnp.arrays(
        dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))),
    min_size=1, max_size=4)


def _assemble(payload: bytes, cuts: list[int], size: int, sha: str) -> bytearray:
    asm = codec.Assembler(size, sha, 1 << 30, codec.WIRE_DIGEST)
    bounds = sorted(c % (len(payload) + 1) for c in cuts)
    for a, b in zip([0, *bounds], [*bounds, len(payload)], strict=True):
        asm.add(payload[a:b])
    return asm.finish()


@settings(max_examples=150, deadline=None)
@given(tensors=tensor_sets, cuts=st.lists(st.integers(0, 1 << 16), max_size=8))
def test_any_chunking_reassembles_exactly(tensors: dict[str, np.ndarray],
                                          cuts: list[int]) -> None:
    enc = codec.encode(tensors)
    got, _ = codec.decode(_assemble(enc.to_bytes(), cuts, enc.size, enc.digest))
    assert set(got) == set(tensors)
    for name, arr in tensors.items():
        assert got[name].dtype == arr.dtype.newbyteorder("<") and got[name].shape == arr.shape
        assert got[name].tobytes() == np.ascontiguousarray(arr).tobytes()


@settings(max_examples=150, deadline=None)
@given(tensors=tensor_sets, data=st.data())
def test_truncated_or_flipped_streams_are_refused(tensors: dict[str, np.ndarray],
                                                  data: st.DataObject) -> None:
    enc = codec.encode(tensors)
    payload = bytearray(enc.to_bytes())
    cuts = data.draw(st.lists(st.integers(0, 1 << 16), max_size=8))
    if data.draw(st.booleans()):
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
        with pytest.raises(codec.CodecError, match="truncated"):
            _assemble(bytes(payload), cuts, enc.size, enc.digest)
        return
    for bit in data.draw(st.lists(st.integers(0, len(payload) * 8 - 1), min_size=1,
                                  max_size=5, unique=True)):
        payload[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(codec.CodecError, match="blake3-segments mismatch"):
        _assemble(bytes(payload), cuts, enc.size, enc.digest)


@settings(max_examples=300, deadline=None)
@given(tensors=tensor_sets, data=st.data())
def test_decoding_corrupted_bytes_fails_only_with_codec_error(
        tensors: dict[str, np.ndarray], data: st.DataObject) -> None:
    """Without the digest (an attacker can recompute it) decoding must still be safe."""
    payload = bytearray(codec.encode(tensors).to_bytes())
    for bit in data.draw(st.lists(st.integers(0, len(payload) * 8 - 1), min_size=1,
                                  max_size=8)):
        payload[bit // 8] ^= 1 << (bit % 8)
    expected = codec.spec(tensors)
    try:
        got = decode_and_check(bytes(payload), expected)
    except UpdateRejected:
        return
    # Accepted only if it is a well-formed set of exactly the expected tensors.
    assert codec.spec(got) == expected


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)
entries = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from([*codec.DTYPES, "F8", "", 3]) | json_values,
    "shape": st.lists(st.integers(-2, 1 << 66), max_size=70) | json_values,
    "data_offsets": st.lists(st.integers(-(1 << 65), 1 << 65), max_size=3) | json_values,
})


@settings(max_examples=400, deadline=None)
@given(header=st.dictionaries(st.text(max_size=5), entries | json_values, max_size=4)
       | json_values, body=st.binary(max_size=64), pad=st.integers(-8, 8))
def test_forged_headers_fail_only_with_codec_error(header: object, body: bytes,
                                                   pad: int) -> None:
    head = json.dumps(header).encode()
    buf = struct.pack("<Q", max(0, len(head) + pad)) + head + body
    try:
        tensors, _ = codec.decode(buf)
    except codec.CodecError:
        return
    assert all(isinstance(v, np.ndarray) for v in tensors.values())


def test_hostile_headers_seen_in_the_wild() -> None:
    for head in (b"[" * 200_000,  # nesting deep enough to blow the parser's recursion
                 json.dumps({"a": {"dtype": "F32", "shape": [1 << 70, 0],
                                   "data_offsets": [0, 0]}}).encode(),
                 json.dumps({"a": {"dtype": "F32", "shape": [1] * 70,
                                   "data_offsets": [0, 4]}}).encode(),
                 json.dumps({"a": {"dtype": ["F32"], "shape": [1],
                                   "data_offsets": [0, 4]}}).encode(),
                 json.dumps({"a": {"dtype": "F32", "shape": [True],
                                   "data_offsets": [0, 4]}}).encode()):
        with pytest.raises(codec.CodecError):
            codec.decode(struct.pack("<Q", len(head)) + head + b"\0" * 4)
