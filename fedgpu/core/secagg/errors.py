"""The stages of one secure-aggregation round and the ways a round can fail.

Shared by both sides: a site and the aggregator name a failure by the stage it happened in, so
`fedgpu rounds` can say "2 of 5 sites left after share-keys, threshold 3" instead of a trace.
"""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    """The protocol's steps in order (Bonawitz et al. 2017, rounds 0-4)."""

    SETUP = "setup"
    # Each site sends two X25519 public keys; the aggregator relays them to the neighbours.
    ADVERTISE_KEYS = "advertise-keys"
    # Each site sends Shamir shares of its mask key and self-mask seed, encrypted per recipient.
    SHARE_KEYS = "share-keys"
    # Each site sends its clipped, quantised, weighted and masked update.
    MASKED_INPUT = "masked-input"
    # Signed rounds: each survivor signs the survivor set it was shown; all must agree.
    CONSISTENCY = "consistency-check"
    # Survivors send the shares the aggregator asks for; it removes the masks.
    UNMASK = "unmask"


class SecAggError(ValueError):
    """A protocol violation or a message that cannot be used; the message says which."""


class BelowThreshold(SecAggError):  # noqa: N818 - the failure's name is what rounds show
    """Too few sites survived a stage for the round to finish without revealing anything."""

    def __init__(self, stage: Stage, survivors: int, threshold: int, what: str = "sites") -> None:
        self.stage = stage
        self.survivors = survivors
        self.threshold = threshold
        super().__init__(
            f"secure aggregation failed at {stage}: {survivors} {what} left, threshold "
            f"{threshold}; the round is retried with other sites")


class TooFewInputs(SecAggError):  # noqa: N818 - the failure's name is what rounds show
    """Fewer sites left than the round needs (min_nodes): the attempt ends before any unmask
    request goes out, so no sum of fewer sites is ever unmasked (a retry that then unmasks a
    larger sum would give the difference: one site's update)."""

    def __init__(self, stage: Stage, survivors: int, needed: int) -> None:
        self.stage = stage
        self.survivors = survivors
        self.needed = needed
        super().__init__(
            f"secure aggregation failed at {stage}: {survivors} sites left, the round needs "
            f"{needed}; nothing was unmasked and the round is retried")
