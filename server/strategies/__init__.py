"""Strategies by name, as the job file's `strategy` key names them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedgpu.config import STRATEGIES as JOB_STRATEGIES
from fedgpu.errors import ConfigError
from server.strategies.base import Strategy
from server.strategies.fedadam import FedAdam
from server.strategies.fedavg import FedAvg
from server.strategies.fedavgm import FedAvgM
from server.strategies.median import Median
from server.strategies.trimmed_mean import TrimmedMean

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (FedAvg, FedAvgM, FedAdam, Median, TrimmedMean)
}
# The job parser (which must not import the server) lists the same names.
assert set(STRATEGIES) == set(JOB_STRATEGIES), (sorted(STRATEGIES), JOB_STRATEGIES)


def make_strategy(name: str, params: Mapping[str, Any] | None = None) -> Strategy:
    """A configured strategy; bad [strategy_params] raise ConfigError naming the key."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None
    return cls(params)
