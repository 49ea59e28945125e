"""The job file's secure aggregation: `secure_aggregation = true`, or a `[secure_aggregation]`
table of settings (which turns it on unless it says `enabled = false`).

    [secure_aggregation]
    threshold = 0.5        # more than this fraction of each site's shareholders, or a count
    neighbours = "all"     # or k: each site masks against k others (SecAgg+)
    clip = 1.0             # each value of a site's update (its change to the model) is
                           # clipped to [-clip, clip]
    bits = 20              # quantisation: values become integers of this many bits
    ring_bits = "auto"     # the masked sums live in Z_2^32 when they fit, else Z_2^64 (or 32, 64)
    max_weight = 16777216  # a site's example count counts up to this (a round lowers it to the
                           # power of two above the largest size its sites stated)
    stochastic = true      # unbiased stochastic rounding (false: nearest)
    stage_timeout_s = 60   # how long each protocol stage waits for the sites

Parsed into a frozen `JobSecAgg`; ConfigError names any key or value that is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fedgpu.core.errors import ConfigError
from fedgpu.core.secagg.errors import SecAggError
from fedgpu.core.secagg.params import Settings, submit_majority_problem

DEFAULT_STAGE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class JobSecAgg:
    # The [secure_aggregation] keys themselves (params.py), at the table's top level.
    settings: Settings = field(default_factory=Settings, metadata={"flat": True})
    # Each stage after training (share keys, masked input, unmask) waits at most this long.
    stage_timeout_s: float = DEFAULT_STAGE_TIMEOUT_S


def parse(value: Any, source: str = "job") -> JobSecAgg | None:
    """The job's `secure_aggregation` value (bool or table) -> settings, None when off."""
    if value is None or value is False:
        return None
    if value is True:
        return JobSecAgg()
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: 'secure_aggregation' must be true, false or a table "
                          f"([secure_aggregation]), got {value!r}")
    table = dict(value)
    if isinstance(table.get("settings"), dict):
        # The form Job.to_dict() writes (job store, checkpoints): read back as written.
        table = {**table.pop("settings"), **table}
    known = {*Settings.__dataclass_fields__, "stage_timeout_s", "enabled"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) in [secure_aggregation]: "
                          f"{', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    enabled = table.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise _fail(source, "enabled", "true or false", enabled)
    timeout = table.pop("stage_timeout_s", DEFAULT_STAGE_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            0 < timeout and math.isfinite(timeout)):
        raise _fail(source, "stage_timeout_s", "a positive number of seconds", timeout)
    kwargs: dict[str, Any] = {}
    for key, expected, ok in (
        ("threshold", "a fraction in (0, 1) or a count >= 2",
         lambda v: isinstance(v, int | float)),
        ("neighbours", "\"all\" or a positive integer",
         lambda v: v is None or v == "all" or isinstance(v, int)),
        ("clip", "a positive number", lambda v: isinstance(v, int | float)),
        ("bits", "an integer", lambda v: isinstance(v, int)),
        ("ring_bits", "32, 64 or \"auto\"", lambda v: isinstance(v, int) or v == "auto"),
        ("max_weight", "a positive integer", lambda v: isinstance(v, int)),
        ("stochastic", "true or false", lambda v: isinstance(v, bool)),
    ):
        if key not in table:
            continue
        v = table[key]
        if (isinstance(v, bool) and key != "stochastic") or not ok(v):
            raise _fail(source, key, expected, v)
        kwargs[key] = None if v == "all" else float(v) if key == "clip" else v
    try:
        settings = Settings(**kwargs)
    except SecAggError as exc:
        raise ConfigError(f"{source}: [secure_aggregation] {exc}") from None
    return JobSecAgg(settings, float(timeout)) if enabled else None


def check_job(sa: JobSecAgg | None, strategy: str, mode: str, min_nodes: int,
              source: str = "job") -> None:
    """Refuse, with the reason, jobs secure aggregation cannot serve."""
    if sa is None:
        return
    if min_nodes < 2:
        raise ConfigError(f"{source}: secure_aggregation needs min_nodes >= 2 (the sum of one "
                          f"site's update is that update), got {min_nodes}")
    if mode == "async":
        raise ConfigError(f"{source}: secure_aggregation works in star mode only: it needs "
                          "synchronised rounds (the sites mask one round's sum together), "
                          "not mode = \"async\"")
    if mode != "star":
        raise ConfigError(f"{source}: secure_aggregation works in star mode only: in {mode} "
                          "mode the sites average among themselves and the aggregator holds "
                          "no sum to protect")
    s = sa.settings
    why = submit_majority_problem(s.threshold, s.neighbours, min_nodes)
    if why is not None:
        raise ConfigError(f"{source}: [secure_aggregation] {why}")
    # What secure aggregation can wrap is the strategy table's to say (secagg_problem).
    from fedgpu.core.job.strategies import JOB_STRATEGIES, STRATEGY_SPECS

    spec = STRATEGY_SPECS.get(strategy)
    why = spec.secagg_problem if spec is not None else None
    if why is not None:
        fits = [n for n in JOB_STRATEGIES if STRATEGY_SPECS[n].secagg_problem is None]
        raise ConfigError(f"{source}: strategy {strategy!r} cannot run with "
                          f"secure_aggregation: {why}; use {', '.join(fits)}")


def _fail(source: str, key: str, expected: str, value: object) -> ConfigError:
    return ConfigError(f"{source}: 'secure_aggregation.{key}' must be {expected}, got {value!r}")
