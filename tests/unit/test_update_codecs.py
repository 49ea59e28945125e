"""Compressed updates (int8, top-k): error bounds, error feedback, checks on the compressed
payload, and decoding block by block into the aggregator's sum."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.core.update_codecs import (
    BLOCK,
    ErrorFeedback,
    Int8Tensor,
    TopkTensor,
    UpdateCodec,
    UpdateCodecError,
    decode_update,
    dense,
    encode_update,
)
from fedgpu.server.strategies.aggregate import WeightedSum

RNG = np.random.default_rng(3)


def delta(n: int = 5000, scale: float = 0.01) -> dict[str, np.ndarray]:
    return {"conv.w": (RNG.standard_normal((n // 10, 10)) * scale).astype(np.float32),
            "fc.b": (RNG.standard_normal(10) * scale).astype(np.float32),
            "steps": np.array(3, np.int64)}


def wire(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> dict[str, object]:
    """Through the real payload format: encode (digest of the compressed bytes), decode."""
    enc = codec.encode(tensors, meta)
    got, got_meta = codec.decode(enc.to_bytes())
    return {"tensors": got, "meta": got_meta, "size": enc.size}


def test_int8_round_trip_within_half_a_step_per_block_and_4x_smaller() -> None:
    d = delta(200_000)
    d["conv.w"][0, :3] = [5.0, -7.0, 0.0]  # an outlier block: only its own scale grows
    tensors, meta = encode_update(d, UpdateCodec.INT8)
    w = wire(tensors, meta)
    back = decode_update(w["tensors"], w["meta"], codec.spec(d))
    x = d["conv.w"].reshape(-1)
    got = dense(back["conv.w"]).reshape(-1)
    for b in range(0, x.size, BLOCK):
        step = np.abs(x[b:b + BLOCK]).max() / 127
        assert np.abs(got[b:b + BLOCK] - x[b:b + BLOCK]).max() <= step / 2 * 1.001 + 1e-12
    np.testing.assert_array_equal(back["fc.b"], d["fc.b"])  # small: dense, exact
    assert back["steps"] == 3
    dense_size = codec.encode(d).size
    assert dense_size / w["size"] >= 3.9


def test_topk_keeps_the_largest_values_and_nothing_else() -> None:
    d = delta(100_000)
    tensors, meta = encode_update(d, UpdateCodec.TOPK, topk_fraction=0.01)
    w = wire(tensors, meta)
    back = decode_update(w["tensors"], w["meta"], codec.spec(d))
    x = d["conv.w"].reshape(-1)
    got = dense(back["conv.w"]).reshape(-1)
    k = math.ceil(0.01 * x.size)
    kept = np.flatnonzero(got)
    assert kept.size == k
    np.testing.assert_array_equal(got[kept], x[kept])
    assert np.abs(x[kept]).min() >= np.sort(np.abs(x))[-k]
    assert codec.encode(d).size / w["size"] > 40


@pytest.mark.parametrize("kind", [UpdateCodec.TOPK, UpdateCodec.INT8])
def test_error_feedback_delays_what_compression_left_out(kind: UpdateCodec,
                                                         tmp_path: Path) -> None:
    path = tmp_path / "state" / "residual.safetensors"
    ef = ErrorFeedback(kind, 0.01, path, key="job-1")
    rounds = [delta(20_000) for _ in range(4)]
    sent_total = np.zeros(2000 * 10, np.float64)
    for i, d in enumerate(rounds):
        if i == 2:  # a fresh worker process: the residual comes back from disk
            ef = ErrorFeedback(kind, 0.01, path, key="job-1")
            assert ef.residual
        tensors, meta = ef.compress(d)
        sent = dense(decode_update(tensors, meta, codec.spec(d))["conv.w"])
        sent_total += sent.reshape(-1)
    # Everything the node wanted to send was sent or is still in the residual.
    want = sum(d["conv.w"].reshape(-1).astype(np.float64) for d in rounds)
    np.testing.assert_allclose(sent_total + ef.residual["conv.w"].reshape(-1), want,
                               atol=1e-5)
    if kind is UpdateCodec.TOPK:
        # What was left out accumulates: the residual holds more than one round's leftovers.
        one = rounds[0]["conv.w"].reshape(-1)
        assert np.linalg.norm(ef.residual["conv.w"]) > np.linalg.norm(one) * 0.99 * 1.2
    # Another job (or model) does not inherit the residual.
    assert ErrorFeedback(kind, 0.01, path, key="job-2").residual == {}


@pytest.mark.parametrize("kind", [UpdateCodec.INT8, UpdateCodec.TOPK])
@pytest.mark.parametrize("block", [7, 1536, 1 << 18])
def test_decode_accumulate_equals_decode_then_add(kind: UpdateCodec, block: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Aggregator blocks that cut through codec blocks (7, 1536) and the real one.
    monkeypatch.setattr("fedgpu.server.strategies.aggregate.BLOCK", block)
    ds = [delta(30_000) for _ in range(4)]
    spec = codec.spec(ds[0])
    decoded = [decode_update(*encode_update(d, kind, 0.05), spec) for d in ds]
    assert isinstance(decoded[0]["conv.w"], Int8Tensor | TopkTensor)
    weights = [3.0, 10.0, 7.0, 1.0]
    streamed = WeightedSum(ds[0])
    for dec, w in zip(decoded, weights, strict=True):
        streamed.add(dec, w)
    batched = WeightedSum(ds[0])
    batched.add_many(list(zip(decoded, weights, strict=True))[:1])
    batched.add_many(list(zip(decoded, weights, strict=True))[1:])
    plain = WeightedSum(ds[0])
    for dec, w in zip(decoded, weights, strict=True):
        plain.add({k: dense(v) for k, v in dec.items()}, w)
    want = plain.mean()
    for got in (streamed.mean(), batched.mean()):
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)


def test_the_compressed_payload_is_checked() -> None:
    d = delta(5000)
    spec = codec.spec(d)
    q, meta = encode_update(d, UpdateCodec.INT8)
    t, tmeta = encode_update(d, UpdateCodec.TOPK, 0.1)

    def refused(tensors: dict[str, np.ndarray], metadata: dict[str, str], match: str) -> None:
        with pytest.raises(UpdateCodecError, match=match):
            decode_update(tensors, metadata, spec)

    refused(q, {**meta, "fedgpu.update_codec": "int4"}, "unknown update codec")
    refused(q, {**meta, "fedgpu.codec_block": "512"}, "not one this aggregator reads")
    refused({k: v for k, v in q.items() if not k.startswith("fc.b")}, meta, "missing.*fc.b")
    refused({**q, "extra#q": q["conv.w#q"]}, meta, "'extra#q' is not part")
    for bad in (np.nan, -1.0, np.float32(3e37)):
        s = q["conv.w#s"].copy()
        s[1] = bad
        refused({**q, "conv.w#s": s}, meta, "scales must be finite")
    refused({**q, "conv.w#q": q["conv.w#q"][:-1]}, meta, "q has shape")
    refused({**q, "conv.w#s": q["conv.w#s"].astype(np.float64)}, meta, "s has dtype F64")
    for idx in ([5, 3, 9], [3, 3, 9], [-1, 3, 9], [3, 9, 5000]):
        bad_i = np.array(idx, np.int32)
        refused({**t, "conv.w#i": bad_i, "conv.w#v": np.ones(3, np.float32)}, tmeta,
                "strictly increasing")
    v = t["conv.w#v"].copy()
    v[0] = np.inf
    refused({**t, "conv.w#v": v}, tmeta, "NaN or Inf")
    refused({**q, "conv.w#i": t["conv.w#i"]}, meta, "expected q\\+s, i\\+v or d")
    refused({**q, "fc.b#d": np.zeros(11, np.float32)}, meta, "dense delta")


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize(("start", "stop"), [(0, 3 * BLOCK + 100), (BLOCK, 3 * BLOCK),
                                             (100, 2 * BLOCK + 5), (2 * BLOCK, 2 * BLOCK + 9)])
def test_int8_add_scaled_adds_into_its_span_with_or_without_the_compiled_kernel(
        compiled: bool, start: int, stop: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if not compiled:  # no numba: numpy's decode into the scratch, then the add
        monkeypatch.setattr("fedgpu.core.fused_loops.kernel", lambda name: None)
    x = (RNG.standard_normal(4 * BLOCK) * 0.3).astype(np.float32)
    enc, meta = encode_update({"w": x}, UpdateCodec.INT8)
    src = decode_update(enc, meta, {"w": ("F32", (x.size,))})["w"]
    assert isinstance(src, Int8Tensor)
    out = RNG.standard_normal(stop - start).astype(np.float32)
    want = out + np.float32(0.7) * dense(src)[start:stop]
    src.add_scaled(start, stop, 0.7, out, np.full(stop - start, np.nan, np.float32))
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)
