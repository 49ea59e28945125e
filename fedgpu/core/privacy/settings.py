"""The job file's `[privacy]` table: client-level differential privacy, parsed strictly.

```toml
[privacy]
mode = "central"          # "central" | "local" | "distributed"
clip_norm = 1.0           # or adaptive_clip = true (+ target_quantile, clip_learning_rate)
noise_multiplier = 1.0    # std of the noise / clip norm; may be derived from target_epsilon
target_epsilon = 8.0      # the job ends before a round would spend more
delta = 1e-5
```

Each problem is a ConfigError naming the key and what it must be: a privacy setting that is
silently ignored is a guarantee that is silently false.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from fedgpu.core.errors import ConfigError
from fedgpu.core.privacy.accountant_names import ACCOUNTANTS

# The job's end reason when the next round would exceed target_epsilon (budget_spent says
# after how many rounds and how much).
BUDGET_SPENT_REASON = "privacy budget spent"


def budget_spent(rounds: int, spent: float, target: float) -> str:
    """"privacy budget spent after 9 rounds, epsilon 7.59 of 8": why a job ended."""
    return (f"{BUDGET_SPENT_REASON} after {rounds} round{'s' if rounds != 1 else ''}, "
            f"epsilon {spent:.2f} of {target:g}")


def one_round_problem(mode: str, noise: float | None, target: float | None, delta: float,
                      accountant: str = "rdp") -> str | None:
    """Why a budget cannot pay for even one round at the given noise (the job would "finish"
    with no round), naming the multiplier it would need; None when it can, or when the noise
    is derived from the budget. Local mode accounts z / 2 (module docstring of
    server/strategies/private.py), so the multiplier it needs is twice the accounted one."""
    if noise is None or target is None or noise == 0:
        return None
    # dp-accounting (scipy) only for a job that gives both.
    from fedgpu.core.privacy.accountant import RoundEvent, epsilon_of, noise_for_budget

    factor = 2.0 if mode == "local" else 1.0
    first = epsilon_of([RoundEvent(1.0, noise / factor)], delta, accountant)
    if first <= target:
        return None
    needed = factor * noise_for_budget(target, delta, 1.0, 1, accountant)
    return (f"one round at noise_multiplier = {noise:g} spends epsilon {first:.3g}, more than "
            f"target_epsilon = {target:g}: no round would run; set noise_multiplier to at "
            f"least {needed:.3g}, or target_epsilon to at least {first:.3g}")
# Andrew et al. 2021 ("Differentially private learning with adaptive clipping"): the clip starts
# small and moves geometrically towards the target quantile of the updates' norms.
DEFAULT_INITIAL_CLIP = 0.1
DEFAULT_TARGET_QUANTILE = 0.5
DEFAULT_CLIP_LEARNING_RATE = 0.2
# Above this a noise multiplier is a unit mistake (the noise would drown any model).
MAX_NOISE_MULTIPLIER = 1000.0


class PrivacyMode(StrEnum):
    """Where the clipping and the noise happen."""

    # The aggregator (trusted) clips each update and noises the aggregate.
    CENTRAL = "central"
    # Each node clips and noises its own update before upload: the aggregator is not trusted.
    LOCAL = "local"
    # Each node clips and adds a share of the noise; secure aggregation hides the single
    # updates, so the aggregator only ever sees the noised sum.
    DISTRIBUTED = "distributed"


@dataclass(frozen=True)
class PrivacySettings:
    # Where the clipping and the noise happen: the aggregator (central), each node before
    # upload (local), or shares on the nodes under secure aggregation (distributed).
    mode: PrivacyMode
    # The clip: the L2 norm of a whole update (local model - global model), or the adaptive
    # clip's starting value (default 0.1 then). Required without adaptive_clip.
    clip_norm: float
    # Central mode: the clip follows target_quantile of the updates' norms (Andrew et al.).
    adaptive_clip: bool = False
    # adaptive_clip: the share of updates the clip aims to leave unclipped.
    target_quantile: float = DEFAULT_TARGET_QUANTILE
    # adaptive_clip: the clip moves by exp(-rate * (unclipped share - target_quantile)).
    clip_learning_rate: float = DEFAULT_CLIP_LEARNING_RATE
    # adaptive_clip: std of the noise on the count of unclipped updates; none: the larger of
    # a twentieth of the round's updates and noise_multiplier.
    clipped_count_stddev: float | None = None
    # Noise std / clip_norm (on the sum of the updates); none: derived at the job's start
    # from target_epsilon so that all its rounds fit.
    noise_multiplier: float | None = None
    # The job ends (finished, "privacy budget spent") before a round that would exceed it.
    target_epsilon: float | None = None
    # The delta of every epsilon the job reports.
    delta: float = 1e-5
    # dp-accounting's Renyi DP ("rdp") or privacy loss distributions ("pld", tighter).
    accountant: str = "rdp"

    @property
    def budgeted(self) -> bool:
        return self.target_epsilon is not None


_KEYS = ("mode", "clip_norm", "adaptive_clip", "target_quantile", "clip_learning_rate",
         "clipped_count_stddev", "noise_multiplier", "target_epsilon", "delta", "accountant")


def dp_strategies() -> tuple[str, ...]:
    """Strategies whose result is a function of the mean of the updates alone: noise
    calibrated to the mean protects them (server/strategies/private.py); a median is another
    matter. The strategy table says which (`dp_ok`)."""
    from fedgpu.core.job.strategies import JOB_STRATEGIES, STRATEGY_SPECS

    return tuple(n for n in JOB_STRATEGIES if STRATEGY_SPECS[n].dp_ok)


def parse_privacy(table: object, source: str = "job", *, strategy: str = "fedavg",
                  job_mode: str = "star", secure_aggregation: bool = False) -> PrivacySettings:
    """The `[privacy]` table as settings, for a job with this strategy and mode; every problem
    is a ConfigError naming the key."""
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: 'privacy' must be a table ([privacy]), got {table!r}")
    # TOML has no null: a None is an unset key of a stored job (Job.to_dict) read back.
    table = {k: v for k, v in table.items() if v is not None}
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) in [privacy]: {', '.join(unknown)}; "
                          f"allowed: {', '.join(sorted(_KEYS))}")
    if "mode" not in table:
        raise ConfigError(f"{source}: [privacy] needs 'mode' "
                          f"({' | '.join(repr(m.value) for m in PrivacyMode)})")
    try:
        mode = PrivacyMode(table["mode"])
    except ValueError:
        raise _fail(source, "mode", " | ".join(repr(m.value) for m in PrivacyMode),
                    table["mode"]) from None
    if job_mode == "async":
        raise ConfigError(f"{source}: [privacy] needs mode = \"star\": it accounts per "
                          "synchronised round, which mode = \"async\" does not have")
    if job_mode != "star":
        why = ("in ring mode the nodes average among themselves" if job_mode == "ring"
               else f"mode = {job_mode!r} uploads no update")
        raise ConfigError(f"{source}: [privacy] needs mode = \"star\" ({why}: no aggregate "
                          "to clip and noise)")
    if strategy not in dp_strategies():
        raise ConfigError(f"{source}: [privacy] needs a strategy that averages "
                          f"({', '.join(dp_strategies())}), not {strategy!r}: the noise is "
                          "calibrated to the mean of the clipped updates")
    if mode is PrivacyMode.DISTRIBUTED and not secure_aggregation:
        # The noise shares only protect anything when the aggregator sees their sum alone.
        raise ConfigError(
            f"{source}: [privacy] mode = \"distributed\" needs secure_aggregation: each site "
            "adds only a share of the noise, so the aggregator must never see a single update "
            "(set secure_aggregation = true, or use mode = \"central\" or \"local\")")
    adaptive = _bool(table, "adaptive_clip", False, source)
    clip = _number(table, "clip_norm", source, "a positive number (an L2 norm)", low=0.0)
    if clip is None and not adaptive:
        raise ConfigError(f"{source}: [privacy] needs 'clip_norm' (the L2 norm every update is "
                          "clipped to), or adaptive_clip = true")
    if adaptive and mode is PrivacyMode.DISTRIBUTED:
        # The clip moves with the share of updates it clipped; under secure aggregation each
        # site's clipped-bit would have to be noised and summed inside the protocol too, or it
        # tells the aggregator about one site's update. This version does not do that.
        raise ConfigError(
            f"{source}: [privacy] adaptive_clip cannot run with mode = \"distributed\": the "
            "clip follows how many updates were clipped, and a site's clipped-bit would leak "
            "through secure aggregation unless it were itself noised and summed inside the "
            "protocol, which this version does not do; give a fixed clip_norm")
    if adaptive and mode is not PrivacyMode.CENTRAL:
        raise ConfigError(
            f"{source}: [privacy] adaptive_clip needs mode = \"central\": the clip follows the "
            "norms of the updates, which only the aggregator sees")
    quantile = _number(table, "target_quantile", source, "a number in (0, 1)", low=0.0, high=1.0)
    rate = _number(table, "clip_learning_rate", source, "a positive number", low=0.0)
    count_std = _number(table, "clipped_count_stddev", source, "a positive number", low=0.0)
    if not adaptive:
        # A default value is let through: a stored job (Job.to_dict) carries every field.
        for key, value, default in (
                ("target_quantile", quantile, DEFAULT_TARGET_QUANTILE),
                ("clip_learning_rate", rate, DEFAULT_CLIP_LEARNING_RATE),
                ("clipped_count_stddev", count_std, None)):
            if value is not None and value != default:
                raise ConfigError(f"{source}: [privacy] {key} only applies with "
                                  "adaptive_clip = true")
    noise = _number(table, "noise_multiplier", source,
                    f"a number from 0 to {MAX_NOISE_MULTIPLIER:g}", low=0.0,
                    high=MAX_NOISE_MULTIPLIER, inclusive=True)
    target = _number(table, "target_epsilon", source, "a positive number", low=0.0)
    delta = _number(table, "delta", source, "a number in (0, 1)", low=0.0, high=1.0)
    if noise is None and target is None:
        raise ConfigError(f"{source}: [privacy] needs 'noise_multiplier', or 'target_epsilon' "
                          "to derive it from")
    if noise == 0 and target is not None:
        raise ConfigError(f"{source}: [privacy] noise_multiplier = 0 spends an infinite epsilon "
                          f"in the first round, so target_epsilon = {target:g} can never hold")
    if adaptive and noise is not None and count_std is not None and noise > 0 \
            and 2 * count_std <= noise:
        # 1/z^2 = 1/z_update^2 + 1/(2 sigma_b)^2: the count's noise alone must stay below z.
        raise ConfigError(
            f"{source}: [privacy] clipped_count_stddev must be more than noise_multiplier / 2 "
            f"({noise / 2:g}): the count's noise takes part of the budget, and the update's "
            "noise would have to be infinite")
    accountant = table.get("accountant", "rdp")
    if accountant not in ACCOUNTANTS:
        raise _fail(source, "accountant", " | ".join(repr(a) for a in ACCOUNTANTS), accountant)
    why = one_round_problem(mode, noise, target, delta if delta is not None else 1e-5,
                            accountant)
    if why is not None:
        raise ConfigError(f"{source}: [privacy] {why}")
    return PrivacySettings(
        mode=mode,
        clip_norm=clip if clip is not None else DEFAULT_INITIAL_CLIP,
        adaptive_clip=adaptive,
        target_quantile=quantile if quantile is not None else DEFAULT_TARGET_QUANTILE,
        clip_learning_rate=rate if rate is not None else DEFAULT_CLIP_LEARNING_RATE,
        clipped_count_stddev=count_std,
        noise_multiplier=noise,
        target_epsilon=target,
        delta=delta if delta is not None else 1e-5,
        accountant=accountant,
    )


def with_dp_rounds(hyperparameters: dict[str, Any], rounds: int) -> dict[str, Any]:
    """The job's hyperparameters with DP-SGD's `dp_rounds` set to the job's rounds when a
    `dp_target_epsilon` is given without it: the target is then the budget of the whole job,
    not of each round (node/rounds/dp_sgd.py derives the noise from both)."""
    if (hyperparameters.get("dp_sgd") is True and "dp_target_epsilon" in hyperparameters
            and "dp_rounds" not in hyperparameters):
        return {**hyperparameters, "dp_rounds": rounds}
    return hyperparameters


def settings_from_dict(raw: dict[str, Any]) -> PrivacySettings:
    """Settings back from `dataclasses.asdict` (a job's stored JSON)."""
    return PrivacySettings(**{**raw, "mode": PrivacyMode(raw["mode"])})


def _fail(source: str, key: str, expected: str, value: object) -> ConfigError:
    return ConfigError(f"{source}: [privacy] {key} must be {expected}, got {value!r}")


def _bool(table: dict[str, Any], key: str, default: bool, source: str) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise _fail(source, key, "true or false", value)
    return value


def _number(table: dict[str, Any], key: str, source: str, expected: str, *, low: float,
            high: float | None = None, inclusive: bool = False) -> float | None:
    """A finite number in (low, high), or [low, high] when `inclusive`; None when absent."""
    if key not in table:
        return None
    value = table[key]
    # bool is an int in Python; clip_norm = true is a mistake.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(source, key, expected, value)
    number = float(value)
    ok = math.isfinite(number) and (number >= low if inclusive else number > low)
    if high is not None:
        ok = ok and (number <= high if inclusive else number < high)
    if not ok:
        raise _fail(source, key, expected, value)
    return number
