"""Job-file keys for federations of unlike sites: time-budgeted local work and compressed
updates (docs/how-to/heterogeneous-sites.md). Parsed here, stored on `Job.hetero`.

    local_work = "time"     every site trains for `round_train_s` seconds each round (a GPU
    round_train_s = 20      site takes many more steps than a CPU one); with strategy
                            "fednova" the aggregator corrects for the unequal steps
    update_codec = "int8"   nodes send their delta 8-bit block-quantised ("topk": only the
    topk_fraction = 0.01    largest topk_fraction of each tensor's values), with error feedback
    mode = "async"          FedBuff: a step as soon as buffer_size updates arrived, each
    buffer_size = 2         weighted by staleness_weighting of its staleness, refused past
    max_staleness = 4       max_staleness model versions
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from fedgpu.core.errors import ConfigError
from fedgpu.core.job.strategies import STRATEGY_SPECS
from fedgpu.core.job_bounds import INT32_MAX, MAX_JOB_NODES
from fedgpu.core.update_codecs import UpdateCodec

E = TypeVar("E", bound=StrEnum)


class LocalWork(StrEnum):
    """What a round asks of each site: the task's epochs, or a fixed training time."""

    EPOCHS = "epochs"
    TIME = "time"


class StalenessWeighting(StrEnum):
    """How much an update trained on an older model counts (server/strategies/hetero_math.py)."""

    SQRT = "sqrt"  # 1 / sqrt(1 + s): FedBuff's
    POLY = "poly"  # 1 / (1 + s): FedAsync's polynomial family, exponent 1
    CONSTANT = "constant"  # 1: no discount (the bound alone guards against stale updates)


# The hyperparameter that carries the budget to the nodes' runner (node/rounds/runner.py).
BUDGET_HPARAM = "round_train_s"


@dataclass(frozen=True)
class HeteroWork:
    # What a round asks of each site: the task's epochs, or `"time"`: train epoch after epoch
    # for round_train_s seconds (see [Unlike sites](../how-to/heterogeneous-sites.md)).
    local_work: LocalWork = LocalWork.EPOCHS
    # With local_work = "time": each round's training time, below round_deadline_s.
    round_train_s: float | None = None
    # How nodes send their update: `"int8"` (8-bit block-wise) or `"topk"` (the largest
    # topk_fraction of each tensor's values) compress their delta, with error feedback.
    update_codec: UpdateCodec = UpdateCodec.NONE
    # With update_codec = "topk": the share of each tensor's values sent.
    topk_fraction: float = 0.01
    # mode = "async" (FedBuff): a step as soon as this many updates arrived (default
    # min_nodes).
    buffer_size: int = 0
    # mode = "async": an update trained on a model more than this many steps old is refused.
    max_staleness: int = 4
    # mode = "async": how an update's staleness s weighs it: `"sqrt"` 1/sqrt(1+s), `"poly"`
    # 1/(1+s), `"constant"` 1.
    staleness_weighting: StalenessWeighting = StalenessWeighting.SQRT

    def to_dict(self) -> dict[str, Any]:
        """Only what differs from the defaults, as job-file keys (a job without them reads
        as it did before they existed, and the dict parses back to the same job)."""
        out: dict[str, Any] = {}
        if self.local_work is not LocalWork.EPOCHS:
            out["local_work"] = self.local_work.value
            out["round_train_s"] = self.round_train_s
        if self.update_codec is not UpdateCodec.NONE:
            out["update_codec"] = self.update_codec.value
            if self.update_codec is UpdateCodec.TOPK:
                out["topk_fraction"] = self.topk_fraction
        if self.buffer_size:
            out.update(buffer_size=self.buffer_size, max_staleness=self.max_staleness,
                       staleness_weighting=self.staleness_weighting.value)
        return out


_ASYNC_KEYS = ("buffer_size", "max_staleness", "staleness_weighting")
KEYS = frozenset(("local_work", "round_train_s", "update_codec", "topk_fraction",
                  *_ASYNC_KEYS))


def parse_hetero(raw: Mapping[str, Any], source: str, *, mode: str, strategy: str,
                 deadline_s: float, wire_dtype: str | None, min_nodes: int = 1) -> HeteroWork:
    def fail(key: str, expected: str) -> ConfigError:
        return ConfigError(f"{source}: '{key}' must be {expected}, got {raw.get(key)!r}")

    def choice(key: str, kind: type[E], default: E) -> E:
        value = raw.get(key, default.value)
        if isinstance(value, str) and value in {m.value for m in kind}:
            return kind(value)
        raise fail(key, "one of " + ", ".join(m.value for m in kind))

    work = choice("local_work", LocalWork, LocalWork.EPOCHS)
    budget = raw.get("round_train_s")
    if work is LocalWork.TIME:
        if (isinstance(budget, bool) or not isinstance(budget, int | float)
                or not (0 < budget < deadline_s) or not math.isfinite(budget)):
            raise fail("round_train_s", f"a number of seconds in (0, round_deadline_s = "
                       f"{deadline_s:g}) with local_work = \"time\" (the deadline leaves time "
                       "to upload)")
        if mode == "ring":
            raise ConfigError(f"{source}: local_work = \"time\" is not for ring jobs: ring "
                              "mode steps every node in lockstep ('iterations')")
        budget = float(budget)
    elif budget is not None:
        raise ConfigError(f"{source}: 'round_train_s' needs local_work = \"time\"")

    kind = choice("update_codec", UpdateCodec, UpdateCodec.NONE)
    fraction = raw.get("topk_fraction", 0.01)
    if "topk_fraction" in raw and kind is not UpdateCodec.TOPK:
        raise ConfigError(f"{source}: 'topk_fraction' needs update_codec = \"topk\"")
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not (
            0 < fraction <= 1):
        raise fail("topk_fraction", "a number in (0, 1]")
    if kind is not UpdateCodec.NONE:
        if mode == "ring":
            raise ConfigError(f"{source}: update_codec = \"{kind}\" is not for ring jobs: in "
                              "ring mode nodes average among themselves")
        if _dense_only(strategy):
            raise ConfigError(f"{source}: update_codec = \"{kind}\" does not go with strategy "
                              f"{strategy!r}, which needs every update dense")
        if wire_dtype is not None:
            raise ConfigError(f"{source}: choose update_codec or wire_dtype, not both (the "
                              "codec already decides how updates travel)")
    buffered = _parse_async(raw, source, mode, strategy, min_nodes, fail)
    return HeteroWork(work, budget, kind, float(fraction), *buffered)


def _dense_only(strategy: str) -> bool:
    """The strategy needs every update dense in memory (it spills and sorts): no codec, no
    buffer (the strategy table's `dense_only`)."""
    spec = STRATEGY_SPECS.get(strategy)
    return spec is not None and spec.dense_only


def _parse_async(raw: Mapping[str, Any], source: str, mode: str, strategy: str, min_nodes: int,
                 fail: Any) -> tuple[int, int, StalenessWeighting]:
    if mode != "async":
        given = [k for k in _ASYNC_KEYS if k in raw]
        if given:
            raise ConfigError(f"{source}: {', '.join(given)} need mode = \"async\"")
        return 0, 4, StalenessWeighting.SQRT
    if strategy != "fedavg":
        why = ("needs every update of a synchronised round"
               if _dense_only(strategy) else "is not supported in async mode yet")
        raise ConfigError(f"{source}: mode = \"async\" runs FedBuff, whose step is the "
                          f"staleness-weighted FedAvg of a buffer: strategy {strategy!r} {why}; "
                          "use strategy = \"fedavg\"")
    size = raw.get("buffer_size", min_nodes)
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_JOB_NODES:
        raise fail("buffer_size", f"an integer from 1 to {MAX_JOB_NODES} (updates per step)")
    bound = raw.get("max_staleness", 4)
    if isinstance(bound, bool) or not isinstance(bound, int) or not 0 <= bound <= INT32_MAX:
        raise fail("max_staleness", f"an integer from 0 to {INT32_MAX} (model versions; "
                   "round numbers are int32 on the wire)")
    try:
        weighting = StalenessWeighting(raw.get("staleness_weighting", "sqrt"))
    except ValueError:
        raise fail("staleness_weighting", "one of " + ", ".join(
            w.value for w in StalenessWeighting)) from None
    return size, bound, weighting
