"""The job's privacy accountant: rounds of the sampled Gaussian mechanism -> (epsilon, delta).

Each round is one event: the nodes were sampled with rate q (sampled / available; 1 when all
take part, and always 1 in local mode, where a node's participation is no secret) and their
clipped updates were noised with multiplier z. dp-accounting (Google's, maintained) composes the
events with Renyi DP or privacy loss distributions; nothing here does the mathematics itself.

The record is a list of (q, z) pairs, plain numbers that a job's checkpoint keeps; epsilon is
recomputed from them, so a resumed job continues the same account.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby

import dp_accounting
from dp_accounting import pld, rdp

from fedgpu.core.privacy.accountant_names import ACCOUNTANTS


class _QuietOrders(logging.Filter):
    """dp-accounting's RDP logs a warning for every fractional order its series does not
    converge at and then leaves that order out, which is correct: no reason to fill a log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_QuietOrders())


@dataclass(frozen=True)
class RoundEvent:
    sampling_rate: float
    noise_multiplier: float

    def __post_init__(self) -> None:
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"a sampling rate is in (0, 1], got {self.sampling_rate!r}")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"a noise multiplier is >= 0, got {self.noise_multiplier!r}")


def _event(e: RoundEvent) -> dp_accounting.DpEvent:
    if e.noise_multiplier == 0:
        return dp_accounting.NonPrivateDpEvent()
    gauss = dp_accounting.GaussianDpEvent(e.noise_multiplier)
    if e.sampling_rate == 1:
        return gauss
    return dp_accounting.PoissonSampledDpEvent(e.sampling_rate, gauss)


def _fresh(kind: str) -> dp_accounting.PrivacyAccountant:
    if kind == "rdp":
        return rdp.RdpAccountant()
    if kind == "pld":
        return pld.PLDAccountant()
    raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {kind!r}")


def epsilon_of(events: Iterable[RoundEvent], delta: float, kind: str = "rdp") -> float:
    """Epsilon at `delta` after `events`, in order; 0 for none, inf when one had no noise."""
    accountant = _fresh(kind)
    # Runs of equal rounds compose as one self-composed event: a 1000-round job costs little.
    for event, run in groupby(events):
        count = sum(1 for _ in run)
        accountant.compose(_event(event), count)
    return float(accountant.get_epsilon(delta))


class Accountant:
    """The privacy spent by a job's rounds so far, and whether the next would exceed a budget."""

    def __init__(self, delta: float, kind: str = "rdp",
                 events: Sequence[RoundEvent] = ()) -> None:
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        _fresh(kind)  # refuse an unknown kind now, not at the first round
        self.delta = delta
        self.kind = kind
        self.events: list[RoundEvent] = list(events)
        self._spent = epsilon_of(self.events, delta, kind)

    @property
    def rounds(self) -> int:
        return len(self.events)

    @property
    def epsilon(self) -> float:
        """Epsilon spent by the rounds recorded (at this accountant's delta)."""
        return self._spent

    def epsilon_after(self, sampling_rate: float, noise_multiplier: float) -> float:
        """Epsilon if one more round ran with these settings."""
        return epsilon_of([*self.events, RoundEvent(sampling_rate, noise_multiplier)],
                          self.delta, self.kind)

    def would_exceed(self, target_epsilon: float, sampling_rate: float,
                     noise_multiplier: float) -> bool:
        """Whether the next round would take the spent epsilon past `target_epsilon`."""
        return self.epsilon_after(sampling_rate, noise_multiplier) > target_epsilon

    def record(self, sampling_rate: float, noise_multiplier: float) -> float:
        """One finished round; returns the epsilon spent so far."""
        self.events.append(RoundEvent(sampling_rate, noise_multiplier))
        self._spent = epsilon_of(self.events, self.delta, self.kind)
        return self._spent

    def to_list(self) -> list[list[float]]:
        """The record as JSON-ready pairs [q, z], for a checkpoint."""
        return [[e.sampling_rate, e.noise_multiplier] for e in self.events]

    @classmethod
    def from_list(cls, pairs: Iterable[Sequence[float]], delta: float,
                  kind: str = "rdp") -> Accountant:
        return cls(delta, kind, [RoundEvent(float(q), float(z)) for q, z in pairs])


def noise_for_budget(target_epsilon: float, delta: float, sampling_rate: float, rounds: int,
                     kind: str = "rdp") -> float:
    """The smallest noise multiplier whose `rounds` rounds at `sampling_rate` stay within
    `target_epsilon` (dp-accounting's calibration, a bisection on the accountant)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    RoundEvent(sampling_rate, 1.0)  # checks the rate

    def event(z: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(_event(RoundEvent(sampling_rate, z)), rounds)

    z = dp_accounting.calibrate_dp_mechanism(
        lambda: _fresh(kind), event, target_epsilon, delta,
        dp_accounting.LowerEndpointAndGuess(0.0, 1.0), tol=1e-4)
    # The bisection's upper end: the budget holds at it (a hair above the exact value).
    return float(z)
