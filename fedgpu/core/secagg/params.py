"""Secure-aggregation settings: the job's `[secure_aggregation]` table and one round's numbers.

`Settings` is what an operator writes (fractions, "all", "auto"); `RoundParams` is what they
mean for a round of n sites and a model of `length` values, resolved by the aggregator and sent
to every site in its setup message, which checks them again (a site never trusts numbers it can
verify).

`ring_bits = "auto"` (the default) picks the smaller ring, Z_2^32, whenever the round's largest
possible sum fits in it, else Z_2^64: the sum is exact either way, and a 32-bit masked input is
half the bytes. What fits depends on the round's weight bound: the aggregator lowers
`max_weight` to the power of two at or above the largest training-set size the chosen sites
stated when they registered (updates may not claim more in a plain round either), and every
site caps its weight at the bound it is sent, so no site can push the sum past it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedgpu.core.secagg import graph
from fedgpu.core.secagg.errors import BelowThreshold, SecAggError, Stage
from fedgpu.core.secagg.masked_metrics import SLOTS
from fedgpu.core.secagg.quantize import levels

# Wire bounds: every count and size a decoder accepts is checked against these.
MAX_SITES = 1 << 16
MAX_LENGTH = 1 << 34
AUTO = "auto"
RINGS = (32, 64)


def fits(n_sites: int, max_weight: int, bits: int, ring_bits: int) -> bool:
    """True when n sites' sums cannot wrap around Z_2^ring_bits: every value of the sum is at
    most n * max_weight * L in magnitude (L = 2^(bits-1) - 1, the quantised magnitude), the
    weight's element at most n * max_weight, and both must stay below 2^(ring_bits - 1) to be
    read back as signed integers."""
    return n_sites * max_weight * levels(bits) < 1 << (ring_bits - 1)


def weight_bound(max_weight: int, stated: list[int]) -> int:
    """The round's weight bound: `max_weight`, lowered to the power of two at or above the
    largest of the chosen sites' stated training-set sizes when every one of them stated its
    size (0: not stated). A power of two tells a site the order of the largest size only."""
    if not stated or min(stated) <= 0:
        return max_weight
    return min(max_weight, 1 << (max(stated) - 1).bit_length())


def majority_problem(threshold: int, degree: int, site_minimum: int = 0) -> str | None:
    """Why a site must refuse a round with this threshold; None when it may take part.

    Each secret of a site is shared among its k neighbours and itself. An aggregator that
    tells some of them "site u survived" and the others "site u dropped" collects shares of
    u's self-mask seed (from the first group and u itself) and of its mask key (from the
    second): with 2t <= k + 1 both reach t and u's update comes out alone. A strict majority
    of the k + 1 shareholders (2t > k + 1) leaves no room for two such groups."""
    holders = degree + 1
    if 2 * threshold <= holders:
        return (f"threshold {threshold} is not a strict majority of the {holders} "
                f"shareholders of each secret (k = {degree} neighbours and the site): an "
                f"aggregator that shows some of them a site as survived and the others as "
                f"dropped could rebuild both of its secrets; at least {holders // 2 + 1} is "
                "needed")
    if threshold < site_minimum:
        return (f"threshold {threshold} is below this site's minimum of {site_minimum} "
                "(--secagg-min-threshold)")
    return None


def submit_majority_problem(threshold: float | int, neighbours: int | None,
                            min_nodes: int) -> str | None:
    """`job submit`'s check of `[secure_aggregation]` threshold: None when every round the job
    can have (at least min_nodes sites) gets a strict majority, else why not. A fraction
    resolves to more than f of the shareholders, so f >= 0.5 always does; a count does for a
    fixed `neighbours` when 2t > k + 1 (k rounded up to even, as an odd round makes it), and
    with every site a neighbour only while rounds stay below 2t sites (checked at min_nodes
    here; each round's sites and the aggregator check the round itself)."""
    if isinstance(threshold, float):
        if threshold < 0.5:
            return (f"threshold {threshold} would let a round run with fewer than a strict "
                    "majority of each secret's shareholders (a site refuses such a round); "
                    "use a fraction of at least 0.5")
        return None
    if neighbours is not None:
        worst = neighbours + neighbours % 2
        return majority_problem(threshold, worst)
    return majority_problem(threshold, max(min_nodes, 2) - 1)


@dataclass(frozen=True)
class Settings:
    """The job's choices; defaults give the original SecAgg (every site a neighbour)."""

    # Shares needed to rebuild a secret: a fraction f in (0, 1) means more than f of a site's
    # shareholders (its neighbours and itself); an integer >= 2 is an absolute count.
    threshold: float | int = 0.5
    # The degree k of the neighbour graph; None = every other site ("all").
    neighbours: int | None = None
    # Updates (the change a round made to the model) are clipped to [-clip, clip] per value.
    clip: float = 1.0
    # Quantisation: values become integers in [-(2^(bits-1) - 1), 2^(bits-1) - 1]; the mean's
    # error per value is at most clip / (2^(bits-1) - 1) (1.9e-6 at clip 1 with 20 bits).
    bits: int = 20
    # The ring Z_2^ring_bits the masked sums live in: 32, 64, or "auto": 32 whenever the
    # round's largest possible sum fits in it (sites x weight bound x 2^(bits-1)), else 64.
    ring_bits: int | str = AUTO
    # A site's weight (its example count) counts up to this much; a round lowers it to the
    # power of two at or above the largest training-set size its sites stated.
    max_weight: int = 1 << 24
    # Stochastic rounding is unbiased; nearest rounding halves the worst-case error.
    stochastic: bool = True

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not (isinstance(t, int) and 2 <= t <= MAX_SITES
                                       or isinstance(t, float) and 0 < t < 1):
            raise SecAggError(f"threshold must be a fraction in (0, 1) or a count >= 2, got {t!r}")
        if self.neighbours is not None and not 1 <= self.neighbours < MAX_SITES:
            raise SecAggError(f"neighbours must be \"all\" or at least 1, got {self.neighbours}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise SecAggError(f"clip must be a positive number, got {self.clip}")
        if self.ring_bits not in (*RINGS, AUTO) or isinstance(self.ring_bits, bool):
            raise SecAggError(f"ring_bits must be 32, 64 or \"auto\", got {self.ring_bits!r}")
        widest = self.ring_bits if isinstance(self.ring_bits, int) else max(RINGS)
        if not 2 <= self.bits <= widest - 2:
            raise SecAggError(f"bits must be between 2 and {widest - 2}, got {self.bits}")
        if not 1 <= self.max_weight < 1 << 48:
            raise SecAggError(f"max_weight must be between 1 and 2^48, got {self.max_weight}")

    def resolve(self, n: int, length: int, stated: list[int] | None = None,
                metrics: bool = False) -> RoundParams:
        """The round's numbers for n sites and a model of `length` values (`stated`: the sites'
        stated training-set sizes, when known; `metrics`: the sites' training numbers travel
        masked after the weight, fedgpu/core/secagg/masked_metrics.py); BelowThreshold when
        n sites cannot reach the threshold, SecAggError when the sum could overflow the ring
        asked for."""
        k = graph.degree(n, self.neighbours)
        holders = k + 1
        t = self.threshold
        need = t if isinstance(t, int) else max(2, math.floor(t * holders) + 1)
        if need > holders:
            raise BelowThreshold(Stage.SETUP, holders, need, "shareholders per site")
        why = majority_problem(need, k)
        if why is not None:
            # The sites would refuse the setup: the round cannot start.
            raise SecAggError(f"{n} sites: {why}")
        weight = weight_bound(self.max_weight, stated or [])
        ring = self.ring_bits
        if not isinstance(ring, int):
            ring = next((r for r in RINGS if fits(n, weight, self.bits, r)), max(RINGS))
        params = RoundParams(n_sites=n, degree=k, threshold=need, clip=self.clip,
                             bits=self.bits, ring_bits=ring, max_weight=weight,
                             stochastic=self.stochastic, length=length,
                             metrics=SLOTS if metrics else 0)
        params.check()
        return params


@dataclass(frozen=True)
class RoundParams:
    """One round's protocol numbers, identical at every site and the aggregator."""

    n_sites: int
    degree: int
    threshold: int
    clip: float
    bits: int
    ring_bits: int
    max_weight: int
    stochastic: bool
    # Values in the model's update; the masked vector has one more (the weight), then
    # `metrics` elements (0 or masked_metrics.SLOTS): the sites' training numbers.
    length: int
    metrics: int = 0

    @property
    def vector_length(self) -> int:
        """Elements of a masked input."""
        return self.length + 1 + self.metrics

    def check(self) -> None:
        if not 2 <= self.n_sites <= MAX_SITES:
            raise SecAggError(f"secure aggregation needs 2 to {MAX_SITES} sites, got "
                              f"{self.n_sites} (one site's sum is its update)")
        if graph.degree(self.n_sites, self.degree) != self.degree:
            raise SecAggError(f"no {self.degree}-regular graph on {self.n_sites} sites")
        if not 2 <= self.threshold <= self.degree + 1:
            raise SecAggError(f"threshold {self.threshold} must be between 2 and "
                              f"{self.degree + 1} (the shareholders of each secret)")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise SecAggError(f"clip must be a positive number, got {self.clip}")
        if self.ring_bits not in (32, 64) or not 2 <= self.bits <= self.ring_bits - 2:
            raise SecAggError(f"bits {self.bits} do not fit the ring Z_2^{self.ring_bits}")
        if not 1 <= self.max_weight < 1 << 48 or not 1 <= self.length <= MAX_LENGTH:
            raise SecAggError("max_weight or the model's length is out of range")
        if self.metrics not in (0, SLOTS):
            raise SecAggError(f"a round's masked metrics take 0 or {SLOTS} elements, not "
                              f"{self.metrics}")
        # The largest |sum| the ring must hold without wrapping around.
        if not fits(self.n_sites, self.max_weight, self.bits, self.ring_bits):
            raise SecAggError(
                f"{self.n_sites} sites x max_weight {self.max_weight} x 2^{self.bits - 1} "
                f"overflows Z_2^{self.ring_bits}: lower bits or max_weight"
                + (", or use ring_bits = 64 (or \"auto\")" if self.ring_bits < 64 else ""))
