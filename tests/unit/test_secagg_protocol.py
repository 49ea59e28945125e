"""Secure aggregation end to end, every party in this process and every message through its
bytes: the unmasked result is plain weighted FedAvg within the quantisation bound for K = 3, 10
and 50 sites with dropouts at every stage; too few survivors fail by name; the aggregator
never asks for (or could rebuild) both secrets of one site; what it gets from one site looks
uniform; and it unmasks with the memory of two models, not K."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fedgpu.core.secagg import graph
from fedgpu.core.secagg.aggregator import AggregatorSession
from fedgpu.core.secagg.errors import BelowThreshold, SecAggError, Stage
from fedgpu.core.secagg.local import run_local
from fedgpu.core.secagg.messages import (
    MaskedInput,
    Setup,
    UnmaskReply,
    UnmaskRequest,
)
from fedgpu.core.secagg.params import Settings
from fedgpu.core.secagg.quantize import encode, error_bound
from fedgpu.core.secagg.site import SiteSession

LENGTH = 2000
# Float32 rounding of a result of magnitude <= 0.5, on top of the quantisation bound.
F32 = 6e-8


def _fleet(k: int, seed: int = 0) -> tuple[list[np.ndarray], list[float]]:
    rng = np.random.default_rng(seed)
    updates = [rng.uniform(-0.5, 0.5, LENGTH).astype(np.float32) for _ in range(k)]
    weights = [float(w) for w in rng.integers(1, 1000, k)]
    return updates, weights


def _fedavg(updates: list[np.ndarray], weights: list[float], sites: set[int],
            clip: float) -> np.ndarray:
    total = sum(weights[i - 1] for i in sites)
    return sum(weights[i - 1] * np.clip(updates[i - 1].astype(np.float64), -clip, clip)
               for i in sites) / total


# K, the graph's degree, and how many sites drop at the stage under test.
FLEETS = [(3, None, 1), (10, None, 2), (50, 12, 3)]
STAGES = [None, Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK]


@pytest.mark.parametrize(("k", "neighbours", "drops"), FLEETS, ids=lambda v: str(v))
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: str(s or "none"))
def test_unmasked_result_is_weighted_fedavg(k: int, neighbours: int | None, drops: int,
                                            stage: Stage | None) -> None:
    updates, weights = _fleet(k)
    settings = Settings(neighbours=neighbours)
    gone = set(range(2, 2 + drops)) if stage else set()
    out, agg = run_local(updates, weights, settings, drop={stage: gone} if stage else {})
    # Sites that dropped before their masked input arrived are left out of the mean; a site
    # that drops during unmasking still counts (its input arrived, its shares are not needed).
    counted = set(range(1, k + 1))
    if stage in (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT):
        counted -= gone
    ref = _fedavg(updates, weights, counted, settings.clip)
    assert out.total_weight == sum(weights[i - 1] for i in counted)
    assert np.abs(out.mean - ref).max() <= error_bound(settings.clip, settings.bits, True) + F32
    assert out.report.masked == len(counted)
    assert out.report.dropped == ({stage: tuple(sorted(gone))} if stage else {})
    assert out.report.recovered == (drops if stage == Stage.MASKED_INPUT else 0)
    assert out.report.seconds > 0


def test_dropouts_at_every_stage_in_one_round() -> None:
    updates, weights = _fleet(10, seed=3)
    drop = {Stage.ADVERTISE_KEYS: {1}, Stage.SHARE_KEYS: {2}, Stage.MASKED_INPUT: {3},
            Stage.UNMASK: {4}}
    out, _ = run_local(updates, weights, Settings(threshold=6), drop=drop)
    counted = set(range(4, 11))
    ref = _fedavg(updates, weights, counted, 1.0)
    assert np.abs(out.mean - ref).max() <= error_bound(1.0, Settings().bits, True) + F32
    assert out.report.masked == 7 and out.report.recovered == 1


def test_clipping_and_coarse_quantisation_meet_the_stated_bound() -> None:
    rng = np.random.default_rng(5)
    updates = [rng.uniform(-3, 3, LENGTH).astype(np.float32) for _ in range(5)]
    weights = [10.0, 1.0, 7.0, 3.0, 3.0]
    for stochastic in (True, False):
        settings = Settings(clip=2.0, bits=10, ring_bits=32, max_weight=1000,
                            stochastic=stochastic)
        out, _ = run_local(updates, weights, settings, drop={Stage.MASKED_INPUT: {2}})
        err = np.abs(out.mean - _fedavg(updates, weights, {1, 3, 4, 5}, 2.0)).max()
        assert err <= error_bound(2.0, 10, stochastic) + F32


@pytest.mark.parametrize("stage", [Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT,
                                   Stage.UNMASK])
def test_below_threshold_fails_by_stage(stage: Stage) -> None:
    updates, weights = _fleet(5)
    # Five shareholders, threshold 3: three gone leaves two.
    with pytest.raises(BelowThreshold) as err:
        run_local(updates, weights, Settings(), drop={stage: {1, 2, 3}})
    assert err.value.stage == stage
    assert (err.value.survivors, err.value.threshold) == (2, 3)
    assert str(stage) in str(err.value)


def test_one_neighbourhood_below_threshold_fails_at_unmask() -> None:
    # SecAgg+: enough sites overall, but both neighbours of site 1 vanish while unmasking, so
    # site 1's self-mask seed (threshold 2 of its 3 shareholders) cannot be rebuilt.
    seed = b"n" * 32
    peers = graph.neighbours(10, 2, seed)[1]
    updates, weights = _fleet(10)
    with pytest.raises(BelowThreshold, match="shares of site 1's self-mask") as err:
        run_local(updates, weights, Settings(neighbours=2, threshold=2),
                  drop={Stage.UNMASK: set(peers)}, graph_seed=seed)
    assert err.value.stage == Stage.UNMASK


def test_aggregator_never_gets_both_secrets_of_a_site() -> None:
    updates, weights = _fleet(10, seed=7)
    replies: list[UnmaskReply] = []

    def observe(stage: Stage, index: int, data: bytes) -> None:
        if stage == Stage.UNMASK:
            replies.append(UnmaskReply.decode(data))

    drop = {Stage.MASKED_INPUT: {2, 5}, Stage.UNMASK: {7}}
    _, agg = run_local(updates, weights, Settings(), drop=drop, observe=observe)
    kinds: dict[int, set[str]] = {}
    for reply in replies:
        for share in reply.shares:
            kinds.setdefault(share.owner, set()).add(share.kind)
    # Every share the aggregator ever received is of one kind per site: self-mask shares of
    # the sites whose input counts, mask-key shares of the two that dropped.
    assert all(len(k) == 1 for k in kinds.values())
    assert {o for o, k in kinds.items() if "mask-key" in k} == {2, 5}
    assert {o for o, k in kinds.items() if "self-mask" in k} == set(range(1, 11)) - {2, 5}
    assert agg.revealed == {**{i: "self-mask" for i in set(range(1, 11)) - {2, 5}},
                            2: "mask-key", 5: "mask-key"}


def _drive_to_masked(k: int, settings: Settings, updates: list[np.ndarray],
                     weights: list[float]) -> tuple[AggregatorSession, dict[int, SiteSession],
                                                    dict[int, bytes]]:
    """Sites and aggregator up to the masked inputs, which are returned as bytes unsent."""
    agg = AggregatorSession(settings.resolve(k, updates[0].size))
    sites = {i: SiteSession(Setup.decode(s.encode())) for i, s in agg.start().items()}
    for s in sites.values():
        agg.receive_keys(s.advertise())
    for i, relay in agg.close_keys().items():
        agg.receive_shares(sites[i].share_keys(relay))
    masked = {i: sites[i].masked_input(relay, updates[i - 1], weights[i - 1]).encode()
              for i, relay in agg.close_shares().items()}
    return agg, sites, masked


def test_sites_refuse_a_request_for_both_secrets_or_a_second_request() -> None:
    updates, weights = _fleet(4)
    agg, sites, masked = _drive_to_masked(4, Settings(), updates, weights)
    for i in (1, 2, 3):
        agg.receive_masked(MaskedInput.decode(masked[i]))
    # A curious aggregator asks site 1 for both of site 4's secrets.
    with pytest.raises(SecAggError, match="double-masking"):
        sites[1].unmask(UnmaskRequest((4,), (1, 2, 3, 4)))
    honest = agg.close_masked()
    sites[2].unmask(honest[2])
    with pytest.raises(SecAggError, match="out of order"):
        sites[2].unmask(UnmaskRequest((), (1, 2, 3, 4)))
    # Site 4's input comes late: its mask key is already asked for, so it no longer counts.
    with pytest.raises(SecAggError, match="while the round is at unmask"):
        agg.receive_masked(MaskedInput.decode(masked[4]))
    assert agg.asked[4] == "mask-key"


def test_what_the_aggregator_receives_from_a_site_looks_uniform() -> None:
    rng = np.random.default_rng(11)
    n = 20_000
    # A strongly structured update: the quantised plaintext is anything but uniform.
    updates = [np.where(np.arange(n) % 2, 0.25, -0.25).astype(np.float32) + i / 100
               for i in range(3)]
    weights = [5.0, 9.0, 2.0]
    settings = Settings(ring_bits=64)  # the high and low halves are looked at below
    _, _, masked = _drive_to_masked(3, settings, updates, weights)
    vector = MaskedInput.decode(masked[1]).vector[:-1]
    plain = encode(updates[0], 5, 1.0, settings.bits, 64, rng)[:-1]

    def chi2(v: np.ndarray) -> float:
        counts = np.bincount(v.view(np.uint8), minlength=256)
        expected = v.nbytes / 256
        return float(((counts - expected) ** 2 / expected).sum())

    # 255 degrees of freedom: mean 255, sd ~22.6. The plaintext is far off; the masked
    # input is where uniform bytes are.
    assert chi2(plain) > 10_000
    assert chi2(vector) < 400
    # No linear trace of the plaintext in the masked values, high or low bits.
    signed = plain.view(np.int64).astype(np.float64)
    for part in (vector >> np.uint64(32), vector & np.uint64(0xFFFFFFFF)):
        r = np.corrcoef(part.astype(np.float64), signed)[0, 1]
        assert abs(r) < 5 / np.sqrt(n)


def test_aggregator_memory_is_two_models_not_k() -> None:
    k, length = 8, 1 << 20
    rng = np.random.default_rng(13)
    updates = [rng.uniform(-0.5, 0.5, length).astype(np.float32) for _ in range(k)]
    weights = [1.0] * k
    agg, sites, masked = _drive_to_masked(k, Settings(), updates, weights)
    model = (length + 1) * 8
    tracemalloc.start()
    try:
        for i in list(masked)[1:]:  # site 1 drops: one dropped site's masks are rebuilt too
            agg.receive_masked(MaskedInput.decode(masked.pop(i)))
        for i, request in agg.close_masked().items():
            agg.receive_unmask(sites[i].unmask(request))
        out = agg.finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The running sum, the float32 mean (half a model) and blocks of keystream; masked
    # inputs arrive as bytes the caller holds, one at a time.
    assert peak < 2 * model, f"aggregator peaked at {peak / model:.2f} models"
    assert out.report.recovered == 1
    ref = _fedavg(updates, weights, set(range(2, k + 1)), 1.0)
    assert np.abs(out.mean - ref).max() <= error_bound(1.0, Settings().bits, True) + F32
