"""Slow links (issue 37.4): each site's measured link rate, and whether a round's model can go
there and an update come back before the round's deadline.

Both sides use this module. A node measures every payload it moves (download and upload, bulk
port or gRPC: bytes over the seconds the transfer took) and smooths the figures (`LinkMeter`,
an EWMA); it sends them with every poll and heartbeat. The aggregator keeps them per site name
(they outlive the site's reconnects) and, before it hands a site a model, estimates the round
trip (`estimate`): model bytes / down rate + update bytes / up rate + the site's last training
time. A site that cannot make the deadline is skipped with the reason in the words an operator
reads ("needs ~180 s at 2.1 Mbit/s, deadline 15 s"), or, with the job's `[transfer]
slow_sites = "compress"`, asked for a compressed update sized to make it (`plan`).

A site with no measurement yet, or one older than MAX_AGE_S, is tried: first contact measures,
and a site skipped once is not skipped forever on a figure from a link that may have recovered.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from enum import StrEnum

from fedgpu.core.update_codecs import UpdateCodec

# Transfers shorter than this say more about latency and thread hand-offs than about the
# link: not measured (a first contact with a tiny model stays "unknown", and is tried).
MIN_MEASURED_BYTES = 64 << 10
# Weight of the newest transfer in the running figure: a link that changes shows within a
# few transfers, one odd transfer does not swing it.
EWMA_ALPHA = 0.5
# A figure older than this is not believed: the site is tried again, and measured again.
MAX_AGE_S = 600.0
# The estimate must fit in this share of the deadline: the rest is slack for the round's
# own overhead (polls, decode, fold) and the estimate's error.
DEADLINE_SHARE = 0.9
# Compressed updates, bytes per float32 model byte: int8 keeps one byte per value plus a
# float32 scale per 1024 (3.98x smaller); top-k keeps an int32 index and a float32 value per
# kept value (2 * fraction of the dense bytes), plus each tensor's header.
INT8_RATIO = 1 / 3.9
TOPK_BYTES_PER_KEPT = 2.0
# Below this share of each tensor, top-k keeps too little for the update to mean much.
MIN_TOPK_FRACTION = 0.001


class SlowSites(StrEnum):
    """The job's `[transfer] slow_sites`: what the aggregator does with a site whose measured
    link cannot move the model and its update within the round's deadline."""

    SKIP = "skip"          # do not hand it the model; the round record says why
    COMPRESS = "compress"  # ask it for a compressed update sized to make the deadline
    TRY = "try"            # hand it the model anyway (it is dropped if it misses)


def mbit(bytes_per_s: float) -> str:
    """'2.1 Mbit/s' (kbit/s below 1 Mbit/s, Gbit/s above 1000)."""
    bits = bytes_per_s * 8
    if bits >= 1e9:
        return f"{bits / 1e9:.1f} Gbit/s"
    if bits >= 1e6:
        return f"{bits / 1e6:.1f} Mbit/s"
    return f"{bits / 1e3:.0f} kbit/s"


class LinkMeter:
    """A node's link rates, each way, smoothed (EWMA over transfers of MIN_MEASURED_BYTES or
    more); 0.0 while unmeasured."""

    def __init__(self) -> None:
        self.down = 0.0
        self.up = 0.0

    def saw(self, way: str, nbytes: int, seconds: float) -> float | None:
        """Fold one transfer of `nbytes` in `seconds` into `way` ("down" | "up"); the
        transfer's own rate, or None when it is too small (or too quick) to say."""
        if nbytes < MIN_MEASURED_BYTES or not (math.isfinite(seconds) and seconds > 0):
            return None
        rate = nbytes / seconds
        old = getattr(self, way)
        setattr(self, way, rate if old <= 0 else EWMA_ALPHA * rate + (1 - EWMA_ALPHA) * old)
        return rate


@dataclass
class SiteLink:
    """What the aggregator knows of one site's link: the rates it reported (bytes/s, 0:
    unknown), when, and its last training time (seconds, 0: unknown)."""

    down: float = 0.0
    up: float = 0.0
    at: float = 0.0
    train_s: float = 0.0

    def report(self, down: float, up: float, now: float | None = None) -> None:
        """A node's figures; nonsense (negative, NaN, inf) is ignored, 0 leaves a way as is."""
        changed = False
        for way, value in (("down", down), ("up", up)):
            if math.isfinite(value) and value > 0:
                setattr(self, way, float(value))
                changed = True
        if changed:
            self.at = time.time() if now is None else now

    def known(self, now: float | None = None) -> bool:
        """A figure for at least one way, recent enough to believe."""
        now = time.time() if now is None else now
        return (self.down > 0 or self.up > 0) and now - self.at <= MAX_AGE_S

    def rates(self) -> tuple[float, float]:
        """(down, up); a way not measured yet is taken to be as fast as the other (a site
        whose upload was never accepted has only its download measured)."""
        return self.down or self.up, self.up or self.down

    def to_dict(self) -> dict[str, float | None]:
        return {"down_bytes_per_s": round(self.down, 1) or None,
                "up_bytes_per_s": round(self.up, 1) or None,
                "measured_at": self.at or None}


def estimate(model_bytes: int, update_bytes: int, down: float, up: float,
             train_s: float = 0.0) -> float:
    """Seconds for a site to download the model, train and upload its update."""
    return model_bytes / down + update_bytes / up + max(0.0, train_s)


@dataclass(frozen=True)
class Admission:
    """The aggregator's answer for one site: hand it the model or not, and with which codec
    (None: the update as the job sends it); `reason` says why when it is not plain."""

    admit: bool
    codec: UpdateCodec | None = None
    topk_fraction: float = 0.0
    reason: str = ""


def compressed_bytes(update_bytes: int, kind: UpdateCodec, fraction: float = 0.0) -> int:
    if kind is UpdateCodec.INT8:
        return math.ceil(update_bytes * INT8_RATIO)
    if kind is UpdateCodec.TOPK:
        return math.ceil(update_bytes * fraction * TOPK_BYTES_PER_KEPT)
    return update_bytes


def plan(link: SiteLink, model_bytes: int, update_bytes: int, deadline_s: float,
         mode: SlowSites, now: float | None = None) -> Admission:
    """Whether to hand a site the round's model (and how it sends its update back)."""
    if mode is SlowSites.TRY or not link.known(now):
        return Admission(True)
    down, up = link.rates()
    need = estimate(model_bytes, update_bytes, down, up, link.train_s)
    budget = deadline_s * DEADLINE_SHARE
    if need <= budget:
        return Admission(True)
    why = f"needs ~{need:.0f} s at {mbit(min(down, up))}, deadline {deadline_s:g} s"
    if mode is SlowSites.COMPRESS:
        left = budget - model_bytes / down - max(0.0, link.train_s)
        room = left * up  # update bytes the link carries in the time left
        if room >= compressed_bytes(update_bytes, UpdateCodec.INT8):
            return Admission(True, UpdateCodec.INT8, 0.0, f"{why}: asked for an int8 update")
        fraction = room / (update_bytes * TOPK_BYTES_PER_KEPT) if update_bytes else 0.0
        if fraction >= MIN_TOPK_FRACTION:
            fraction = min(0.25, math.floor(fraction * 1e4) / 1e4)
            return Admission(True, UpdateCodec.TOPK, fraction,
                             f"{why}: asked for a top-k update ({fraction:g} of each tensor)")
        why += " (even a compressed update would not make it)"
    return Admission(False, reason=why)
