"""Strategies by name, as the job file's `strategy` key names them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedgpu.core.errors import ConfigError
from fedgpu.core.privacy import PrivacySettings
from fedgpu.server.strategies.base import Strategy
from fedgpu.server.strategies.fedadam import FedAdam
from fedgpu.server.strategies.fedavg import FedAvg
from fedgpu.server.strategies.fedavgm import FedAvgM
from fedgpu.server.strategies.fednova import FedNova
from fedgpu.server.strategies.median import Median
from fedgpu.server.strategies.trimmed_mean import TrimmedMean

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (FedAvg, FedAvgM, FedAdam, Median, TrimmedMean, FedNova)
}


def make_strategy(name: str, params: Mapping[str, Any] | None = None,
                  privacy: PrivacySettings | None = None, rounds: int = 1) -> Strategy:
    """A configured strategy; bad [strategy_params] raise ConfigError naming the key. With
    `privacy`, wrapped in client-level DP (server/strategies/private.py) for `rounds` rounds."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None
    if privacy is None:
        return cls(params)
    from fedgpu.server.strategies.private import PrivateStrategy

    return PrivateStrategy(cls(params), privacy, rounds)
