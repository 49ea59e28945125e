"""A site's training numbers inside its masked vector: the aggregator learns only their sums.

In a plain round each site reports its training loss, examples, steps and examples per second
in the clear; under secure aggregation those are facts about one site, so they travel as extra
ring elements after the weight, masked with the rest, and the unmasked sum gives the round's
examples-weighted mean loss (sum of loss x w over sum of w), total examples, total steps and
summed examples per second. The site's evaluation of the model it received (loss and accuracy
on its held-out split) travels the same way, weighted by its held-out examples.

Each number is a signed fixed-point integer (loss x w at 2^-20, examples per second at 2^-10,
counts exact), clamped to |v| < 2^63 and written as DIGITS base-2^16 digits of v mod 2^80, one
digit per ring element. A digit is below 2^16 and a round has at most 2^16 sites, so every
element's sum stays below 2^32: exact in Z_2^32 as in Z_2^64, whatever the ring. The digit
sums recombine to the sum mod 2^80, which is the true sum because |sum| < 2^16 x 2^63 = 2^79.
Each number also has a presence element (1 when the site reported it), so a sum says how many
sites it covers. A site whose job adds distributed-DP noise sends no training number: a sum of
its un-noised statistics would escape the privacy account.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedgpu.core.secagg.errors import SecAggError

DIGIT_BITS = 16
DIGITS = 5
_MOD = 1 << (DIGIT_BITS * DIGITS)
_LIMIT = (1 << 63) - 1


@dataclass(frozen=True)
class Field:
    name: str
    # Fixed-point fraction bits.
    scale: int
    # The site sends value x weight and the weight, and the sum is a weighted mean: "train"
    # weighs by the site's weight (its examples), "eval" by its held-out examples.
    weighted: str = ""
    # A training statistic: a site adding distributed-DP noise sends none (the evaluation of
    # the model it received, on held-out data, is not part of that account).
    train: bool = True


FIELDS = (Field("loss", 20, weighted="train"), Field("examples", 0), Field("steps", 0),
          Field("examples_per_s", 10),
          Field("eval_loss", 20, weighted="eval", train=False),
          Field("eval_accuracy", 20, weighted="eval", train=False),
          Field("num_eval_examples", 0, train=False))
# Ring elements after the weight: per field its digits and its presence, and a weighted
# field's weight digits.
SLOTS = sum(DIGITS + 1 + (DIGITS if f.weighted else 0) for f in FIELDS)


def _digits(value: int) -> list[int]:
    u = value % _MOD
    mask = (1 << DIGIT_BITS) - 1
    return [(u >> (DIGIT_BITS * j)) & mask for j in range(DIGITS)]


def _fixed(value: float, scale: int) -> int:
    return max(-_LIMIT, min(_LIMIT, int(round(value * (1 << scale)))))


def encode(values: Mapping[str, float] | None, weight: int, dtype: np.dtype,
           train: bool = True) -> np.ndarray:
    """The SLOTS elements a site appends: its `values` (train metrics by name, evaluation
    ones as eval_loss, eval_accuracy, num_eval_examples; a missing or non-finite number is
    reported as absent) with its integer `weight`. None: all zeros; `train` False: the
    evaluation only."""
    out = np.zeros(SLOTS, dtype=dtype)
    if values is None:
        return out
    n_eval = values.get("num_eval_examples")
    eval_weight = int(n_eval) if n_eval is not None and math.isfinite(n_eval) else 0
    pos = 0
    for f in FIELDS:
        v = values.get(f.name)
        w = weight if f.weighted == "train" else eval_weight
        present = (v is not None and math.isfinite(v) and (train or not f.train)
                   and (not f.weighted or w > 0))
        if present:
            assert v is not None
            out[pos:pos + DIGITS] = _digits(_fixed(v * w if f.weighted else v, f.scale))
            out[pos + DIGITS] = 1
        pos += DIGITS + 1
        if f.weighted:
            if present:
                out[pos:pos + DIGITS] = _digits(w)
            pos += DIGITS
    return out


def _combine(sums: np.ndarray) -> int:
    total = sum(int(d) << (DIGIT_BITS * j) for j, d in enumerate(sums)) % _MOD
    return total - _MOD if total >= _MOD // 2 else total


def decode(sums: np.ndarray) -> dict[str, dict[str, float | int]]:
    """The unmasked SLOTS elements -> {field: {"value": sum or weighted mean, "sites": how
    many sites reported it}}; a field no site reported is left out."""
    if sums.shape != (SLOTS,):
        raise SecAggError(f"the metrics part of an unmasked sum has {sums.size} elements, "
                          f"expected {SLOTS}")
    out: dict[str, dict[str, float | int]] = {}
    pos = 0
    for f in FIELDS:
        value = _combine(sums[pos:pos + DIGITS])
        sites = int(sums[pos + DIGITS])
        pos += DIGITS + 1
        weight = 0
        if f.weighted:
            weight = _combine(sums[pos:pos + DIGITS])
            pos += DIGITS
        if sites <= 0:
            continue
        number = value / (1 << f.scale)
        if f.weighted:
            if weight <= 0:
                continue
            number /= weight
        out[f.name] = {"value": number if f.scale else int(value), "sites": sites}
    return out
