"""Secure aggregation's building blocks: Shamir, key agreement and AEAD, the mask PRG,
quantisation, the neighbour graph and the settings' checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedgpu.core.secagg import crypto, graph, shamir
from fedgpu.core.secagg.errors import BelowThreshold, SecAggError, Stage
from fedgpu.core.secagg.params import Settings
from fedgpu.core.secagg.prg import MaskStream, Scratch, apply_masks, expand
from fedgpu.core.secagg.quantize import decode_sum, encode, error_bound, levels, site_weight

# --- Shamir -------------------------------------------------------------------------------

# The textbook example (Wikipedia, "Shamir's secret sharing"): f(x) = 1234 + 166x + 94x^2
# over GF(1613), six shares, any three give 1234.
TEXTBOOK = [(1, 1494), (2, 329), (3, 965), (4, 176), (5, 1188), (6, 775)]


def test_shamir_textbook_vector_any_three_of_six() -> None:
    for subset in itertools.combinations(TEXTBOOK, 3):
        shares = [shamir.Share(x, y) for x, y in subset]
        assert shamir.combine_int(shares, prime=1613) == 1234
    two = [shamir.Share(x, y) for x, y in TEXTBOOK[:2]]
    assert shamir.combine_int(two, prime=1613) != 1234


def test_shamir_textbook_polynomial_gives_the_textbook_shares() -> None:
    # split_int draws its coefficients; check the evaluation against the known polynomial.
    for x, y in TEXTBOOK:
        assert (1234 + 166 * x + 94 * x * x) % 1613 == y


@pytest.mark.parametrize(("t", "n"), [(2, 3), (3, 5), (6, 10)])
def test_shamir_any_t_of_n_rebuilds_a_32_byte_secret(t: int, n: int) -> None:
    secret = bytes(range(32))
    xs = list(range(1, n + 1))
    shares = shamir.split(secret, t, xs)
    assert all(len(s.y_bytes()) == shamir.SHARE_BYTES for s in shares)
    for subset in itertools.islice(itertools.combinations(shares, t), 50):
        assert shamir.combine(list(subset)) == secret
    # More than t works too; fewer than t is garbage, which combine refuses.
    assert shamir.combine(shares) == secret
    with pytest.raises(SecAggError, match="do not reconstruct"):
        shamir.combine(shares[: t - 1])


def test_shamir_shares_below_threshold_say_nothing_of_the_secret() -> None:
    # t - 1 shares are uniform whatever the secret: the share at x = 5 of a 3-of-n split,
    # drawn many times in GF(101), has the same flat histogram for two different secrets.
    p = 101
    for secret in (0, 77):
        ys = [shamir.split_int(secret, 3, [5, 6, 7], prime=p)[0].y for _ in range(20_000)]
        counts = np.bincount(ys, minlength=p)
        expected = len(ys) / p
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 200  # 100 degrees of freedom: mean 100, sd 14


def test_shamir_refuses_bad_arguments() -> None:
    with pytest.raises(SecAggError, match="threshold"):
        shamir.split(bytes(32), 4, [1, 2, 3])
    with pytest.raises(SecAggError, match="distinct"):
        shamir.split(bytes(32), 2, [1, 1, 2])
    with pytest.raises(SecAggError, match="non-zero"):
        shamir.split(bytes(32), 2, [0, 1, 2])
    with pytest.raises(SecAggError, match="32 bytes"):
        shamir.split(bytes(16), 2, [1, 2])
    with pytest.raises(SecAggError, match="field"):
        shamir.share_from_bytes(1, b"\xff" * shamir.SHARE_BYTES)


# --- key agreement and share encryption ---------------------------------------------------

def test_x25519_rfc7748_vector() -> None:
    # RFC 7748 section 6.1, Alice's key pair: the library, wired the way we use it.
    alice = crypto.KeyPair.from_secret(bytes.fromhex(
        "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"))
    assert alice.public.hex() == (
        "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")


def test_both_ends_agree_and_contexts_separate() -> None:
    a, b = crypto.KeyPair.generate(), crypto.KeyPair.generate()
    ctx = bytes(32)
    assert crypto.mask_seed(a, b.public, ctx, 1, 2) == crypto.mask_seed(b, a.public, ctx, 2, 1)
    assert crypto.share_key(a, b.public, ctx, 1, 2) == crypto.share_key(b, a.public, ctx, 2, 1)
    # Different uses, rounds and pairs never give the same key.
    keys = {crypto.mask_seed(a, b.public, ctx, 1, 2), crypto.share_key(a, b.public, ctx, 1, 2),
            crypto.mask_seed(a, b.public, b"\1" * 32, 1, 2),
            crypto.mask_seed(a, b.public, ctx, 1, 3)}
    assert len(keys) == 4


def test_sealed_shares_open_only_as_sent() -> None:
    key, ctx = bytes(range(32)), b"c" * 32
    sealed = crypto.seal(key, b"shares", ctx, 3, 7)
    assert crypto.open_sealed(key, sealed, ctx, 3, 7) == b"shares"
    assert crypto.seal(key, b"shares", ctx, 3, 7) != sealed  # fresh nonce each time
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    for args in [(key, tampered, ctx, 3, 7), (key, sealed, ctx, 7, 3),
                 (key, sealed, b"d" * 32, 3, 7), (bytes(32), sealed, ctx, 3, 7)]:
        with pytest.raises(SecAggError, match="do not authenticate"):
            crypto.open_sealed(*args)
    with pytest.raises(SecAggError, match="too short"):
        crypto.open_sealed(key, b"x" * 10, ctx, 3, 7)


def test_low_order_public_key_is_refused() -> None:
    with pytest.raises(SecAggError, match="unusable public key"):
        crypto.mask_seed(crypto.KeyPair.generate(), bytes(32), bytes(32), 1, 2)


# --- the mask PRG -------------------------------------------------------------------------

def test_mask_is_aes256_ctr_from_counter_zero() -> None:
    seed = bytes(range(32))
    ecb = Cipher(algorithms.AES(seed), modes.ECB()).encryptor()
    first = ecb.update(bytes(16)) + ecb.update((1).to_bytes(16, "big"))
    assert expand(seed, 8, np.dtype("<u4")).tobytes() == first


@pytest.mark.parametrize("dtype", ["<u4", "<u8"])
def test_mask_stream_is_the_same_whatever_the_block(dtype: str) -> None:
    seed = b"s" * 32
    whole = expand(seed, 10_000, np.dtype(dtype))
    for block in (1, 7, 4096):
        v = np.zeros(10_000, dtype=dtype)
        apply_masks(v, [(seed, 1)], block=block)
        np.testing.assert_array_equal(v, whole)
    # Adding then subtracting the same mask is the identity mod 2^bits.
    v = np.arange(10_000, dtype=dtype)
    apply_masks(v, [(seed, 1), (b"t" * 32, -1), (seed, -1), (b"t" * 32, 1)])
    np.testing.assert_array_equal(v, np.arange(10_000, dtype=dtype))
    assert not np.array_equal(expand(b"t" * 32, 100, np.dtype(dtype)), whole[:100])


def test_mask_stream_refuses_more_than_a_block_and_bad_seeds() -> None:
    stream = MaskStream(bytes(32), Scratch(np.dtype("<u4"), 16))
    with pytest.raises(SecAggError, match="at most 16"):
        stream.next(17)
    with pytest.raises(SecAggError, match="32 bytes"):
        MaskStream(bytes(16), Scratch(np.dtype("<u4")))
    with pytest.raises(SecAggError, match="unsigned"):
        apply_masks(np.zeros(4, dtype=np.int32), [(bytes(32), 1)])


def test_mask_bytes_look_uniform() -> None:
    data = expand(b"u" * 32, 1 << 16, np.dtype("<u4")).view(np.uint8)
    counts = np.bincount(data, minlength=256)
    expected = data.size / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 255 degrees of freedom: mean 255, sd ~22.6; 400 is beyond 6 sd.
    assert chi2 < 400


# --- quantisation -------------------------------------------------------------------------

@pytest.mark.parametrize(("bits", "ring_bits", "stochastic"),
                         [(24, 64, True), (24, 64, False), (8, 32, False), (16, 32, True)])
def test_quantised_weighted_sum_decodes_within_the_bound(bits: int, ring_bits: int,
                                                         stochastic: bool) -> None:
    rng = np.random.default_rng(1)
    xs = [rng.uniform(-2, 2, 5000).astype(np.float32) for _ in range(3)]
    ws = [3, 10, 1]
    total = sum(encode(x, w, 1.0, bits, ring_bits, rng if stochastic else None)
                for x, w in zip(xs, ws, strict=True))
    mean, weight = decode_sum(np.asarray(total, dtype=f"<u{ring_bits // 8}"), 1.0, bits)
    assert weight == 14
    ref = sum(w * np.clip(x.astype(np.float64), -1, 1) for x, w in zip(xs, ws, strict=True)) / 14
    err = np.abs(mean - ref).max()
    assert err <= error_bound(1.0, bits, stochastic) + 1e-7
    if bits == 8:
        assert err > error_bound(1.0, bits, stochastic) / 10  # the bound is not vacuous


def test_stochastic_rounding_is_unbiased() -> None:
    rng = np.random.default_rng(2)
    x = np.full(200_000, 0.3 / levels(8), dtype=np.float64)  # 0.3 of one step
    q = encode(x, 1, 1.0, 8, 32, rng)[:-1].view(np.int32)
    assert set(np.unique(q)) == {0, 1}
    assert abs(q.mean() - 0.3) < 0.01


def test_quantisation_refuses_non_finite_and_negative_weights() -> None:
    with pytest.raises(SecAggError, match="non-finite"):
        encode(np.array([0.0, np.nan]), 1, 1.0, 8, 32, None)
    with pytest.raises(SecAggError, match="weight"):
        site_weight(-1, 10)
    assert site_weight(1e9, 1000) == 1000
    with pytest.raises(SecAggError, match="total weight"):
        decode_sum(np.zeros(3, dtype=np.uint32), 1.0, 8)


# --- the neighbour graph ------------------------------------------------------------------

@pytest.mark.parametrize(("n", "k"), [(3, 2), (10, 4), (11, 3), (50, 12), (51, 7), (100, 99)])
def test_graph_is_regular_symmetric_and_seeded(n: int, k: int) -> None:
    d = graph.degree(n, k)
    assert d >= min(k, n - 1) and (d * n) % 2 == 0
    g = graph.neighbours(n, d, b"g" * 32)
    assert set(g) == set(range(1, n + 1))
    for i, peers in g.items():
        assert len(peers) == d and i not in peers
        assert all(i in g[j] for j in peers)
    assert g == graph.neighbours(n, d, b"g" * 32)
    if d < n - 2:
        assert g != graph.neighbours(n, d, b"h" * 32)


def test_graph_degree_rules() -> None:
    assert graph.degree(10, None) == 9
    assert graph.degree(10, 50) == 9
    assert graph.degree(11, 3) == 4  # 11 x 3 is odd: no 3-regular graph on 11 sites
    with pytest.raises(SecAggError, match="no 3-regular"):
        graph.neighbours(11, 3, bytes(32))


# --- settings -----------------------------------------------------------------------------

def test_settings_resolve_threshold_and_refuse_overflow() -> None:
    p = Settings().resolve(10, 100)
    assert (p.degree, p.threshold) == (9, 6)  # more than half of 10 shareholders
    p = Settings(neighbours=4, threshold=3).resolve(50, 100)
    assert (p.degree, p.threshold) == (4, 3)
    with pytest.raises(BelowThreshold) as err:
        Settings(threshold=5).resolve(3, 100)
    assert err.value.stage == Stage.SETUP
    with pytest.raises(SecAggError, match="overflows"):
        Settings(bits=16, ring_bits=32, max_weight=10_000).resolve(10, 100)
    with pytest.raises(BelowThreshold, match="1 shareholders"):
        Settings().resolve(1, 100)  # one site's "sum" is its update


@pytest.mark.parametrize("kwargs", [dict(threshold=1), dict(threshold=1.0), dict(threshold=True),
                                    dict(threshold=10**30),
                                    dict(neighbours=0), dict(clip=0.0), dict(clip=float("inf")),
                                    dict(ring_bits=48), dict(bits=63), dict(max_weight=0)])
def test_settings_refuse_bad_values(kwargs: dict) -> None:
    with pytest.raises(SecAggError):
        Settings(**kwargs)
