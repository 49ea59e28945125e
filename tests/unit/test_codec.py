"""The tensor wire codec: round trips, safetensors compatibility, malformed payloads."""

from __future__ import annotations

import hashlib
import json
import struct

import blake3
import ml_dtypes
import numpy as np
import pytest

from fedgpu.core import codec

RNG = np.random.default_rng(0)


def sample() -> dict[str, np.ndarray]:
    return {
        "f32": RNG.standard_normal((3, 5)).astype(np.float32),
        "f16": RNG.standard_normal(7).astype(np.float16),
        "bf16": RNG.standard_normal((2, 2)).astype(ml_dtypes.bfloat16),
        "i64": np.arange(-3, 9, dtype=np.int64).reshape(3, 4),
        "empty": np.zeros((0, 4), np.float32),
        "scalar": np.array(2.5, np.float64),
    }


def roundtrip(tensors: dict[str, np.ndarray], chunk: int,
              algo: codec.DigestAlgo = codec.WIRE_DIGEST) -> dict[str, np.ndarray]:
    enc = codec.encode(tensors, digest=algo)
    chunks = list(codec.iter_chunks(enc, chunk))
    asm = codec.Assembler(enc.size, enc.digest, 1 << 30, algo)
    for c in chunks:
        asm.add(c)
    out, _ = codec.decode(asm.finish())
    return out


@pytest.mark.parametrize("algo", list(codec.DigestAlgo))
@pytest.mark.parametrize("chunk", [1 << 20, 64, 7, 1])
def test_roundtrip_every_dtype_and_chunking(chunk: int, algo: codec.DigestAlgo) -> None:
    t = sample()
    out = roundtrip(t, chunk, algo)
    assert set(out) == set(t)
    for k, v in t.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        assert out[k].tobytes() == v.tobytes(), k


def test_single_and_many_chunks() -> None:
    t = {"w": RNG.standard_normal(300_000).astype(np.float32)}
    enc = codec.encode(t)
    assert len(list(codec.iter_chunks(enc, 1 << 21))) == 1
    many = list(codec.iter_chunks(enc, 4096))
    assert len(many) == -(-enc.size // 4096)
    assert all(len(c) == 4096 for c in many[:-1])
    assert b"".join(many) == enc.to_bytes()
    # BLAKE3 over the segments' BLAKE3 digests by default on the wire, and named (1.2 MB: 32
    # KiB segments, 37 of them); plain BLAKE3 and sha256 on request (older receivers).
    assert enc.algorithm is codec.DigestAlgo.BLAKE3_SEGMENTS
    raw = enc.to_bytes()
    assert blake3.blake3(b"".join(blake3.blake3(raw[i:i + (32 << 10)]).digest()
                                  for i in range(0, len(raw), 32 << 10))).hexdigest() == enc.digest
    plain = codec.encode(t, digest=codec.DigestAlgo.BLAKE3)
    assert blake3.blake3(raw).hexdigest() == plain.digest and not plain.segment_digests
    old = codec.encode(t, digest=codec.DigestAlgo.SHA256)
    assert old.algorithm is codec.DigestAlgo.SHA256
    assert hashlib.sha256(enc.to_bytes()).hexdigest() == old.digest


def test_readable_by_safetensors() -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load

    t = sample()
    loaded = load(codec.encode(t).to_bytes())
    assert loaded["bf16"].dtype == torch.bfloat16
    assert np.array_equal(loaded["f32"].numpy(), t["f32"])
    assert loaded["scalar"].shape == ()


def test_decode_safetensors_written_by_the_library() -> None:
    from safetensors.numpy import save

    t = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.ones(4, np.float16)}
    out, _ = codec.decode(save(t, metadata={"x": "1"}))
    assert np.array_equal(out["a"], t["a"]) and np.array_equal(out["b"], t["b"])


def test_decoded_arrays_are_views_not_copies() -> None:
    buf = bytearray(codec.encode({"w": np.zeros(1000, np.float32)}).to_bytes())
    out, _ = codec.decode(buf)
    assert out["w"].base is not None and not out["w"].flags.owndata


def test_metadata_and_non_contiguous_and_big_endian() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4).T
    b = np.arange(4, dtype=">f4")
    out, meta = codec.decode(codec.encode({"a": a, "b": b}, {"round": "3"}).to_bytes())
    assert meta == {"round": "3"}
    assert np.array_equal(out["a"], a) and np.array_equal(out["b"], b.astype("<f4"))


def test_object_arrays_are_refused() -> None:
    with pytest.raises(codec.CodecError, match="numeric dtypes only"):
        codec.encode({"x": np.array(["a"], dtype=object)})


def _payload(header: dict, data: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"abc", "too short"),
        (struct.pack("<Q", 1 << 40) + b"{}", "does not fit"),
        (struct.pack("<Q", 2) + b"{x", "not valid JSON"),
        (_payload([1, 2]), "not a JSON object"),  # type: ignore[arg-type]
        (_payload({"t": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 1]}}, b"x"),
         "unsupported dtype"),
        (_payload({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"x" * 4),
         "do not match"),
        (_payload({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"x" * 4),
         "malformed shape"),
        (_payload({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"x" * 8),
         "trailing bytes"),
        (_payload({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"x" * 4),
         "starts at 0, expected 4"),
    ],
)
def test_malformed_payloads_are_refused(payload: bytes, message: str) -> None:
    with pytest.raises(codec.CodecError, match=message):
        codec.decode(payload)


def test_assembler_limits_truncation_overflow_and_digest() -> None:
    enc = codec.encode({"w": np.ones(100, np.float32)})
    data = enc.to_bytes()
    # Each defect is its own CodecError subclass with the reason the aggregator counts it by.
    with pytest.raises(codec.PayloadTooLarge, match="exceeds the limit") as err:
        codec.Assembler(enc.size, enc.digest, enc.size - 1, enc.algorithm)
    assert err.value.reason == "too_large"
    asm = codec.Assembler(enc.size, enc.digest, 1 << 20, enc.algorithm)
    asm.add(data[:-1])
    with pytest.raises(codec.Truncated, match="truncated") as err:
        asm.finish()
    assert err.value.reason == "truncated"
    asm = codec.Assembler(enc.size, enc.digest, 1 << 20, enc.algorithm)
    with pytest.raises(codec.CodecError, match="more than the announced") as err:
        asm.add(data + b"x")
    assert type(err.value) is codec.CodecError and err.value.reason == "malformed"
    flipped = bytearray(data)
    flipped[-1] ^= 1
    asm = codec.Assembler(enc.size, enc.digest, 1 << 20, enc.algorithm)
    asm.add(bytes(flipped))
    with pytest.raises(codec.DigestMismatch, match="blake3-segments mismatch") as err:
        asm.finish()
    assert err.value.reason == "digest"


def test_a_queued_upload_takes_the_pooled_buffer_once_it_gets_its_first_byte() -> None:
    from fedgpu.core.buffers import BufferPool

    enc = codec.encode({"w": np.arange(1 << 16, dtype=np.float32)})
    data = enc.to_bytes()
    pool = BufferPool(1 << 30)
    first = codec.Assembler(enc.size, enc.digest, 1 << 30, enc.algorithm, pool)
    first.add(data)
    # The next upload's checks pass while the first payload is still being read ...
    second = codec.Assembler(enc.size, enc.digest, 1 << 30, enc.algorithm, pool)
    with first.finish() as view:
        held = id(view.obj)
    first.release()
    assert pool.held == enc.size
    # ... and its bytes land in the buffer the first one gave back, not in a fresh one.
    second.add(data)
    assert pool.held == 0
    with second.finish() as view:
        assert id(view.obj) == held and bytes(view) == data
    second.release()
