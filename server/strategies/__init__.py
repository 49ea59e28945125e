"""Strategies by name: one class per row of the strategy table (fedgpu/core/job/strategies.py),
registered here under the row's name. Adding a strategy: a row there, a class here (one file),
tests (docs/how-to/add-a-strategy.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedgpu.core.job.strategies import strategy_spec
from fedgpu.core.privacy import PrivacySettings
from fedgpu.server.strategies.base import Strategy
from fedgpu.server.strategies.fedadagrad import FedAdagrad
from fedgpu.server.strategies.fedadam import FedAdam
from fedgpu.server.strategies.fedavg import FedAvg
from fedgpu.server.strategies.fedavgm import FedAvgM
from fedgpu.server.strategies.fednova import FedNova
from fedgpu.server.strategies.fedyogi import FedYogi
from fedgpu.server.strategies.krum import Krum
from fedgpu.server.strategies.median import Median
from fedgpu.server.strategies.multikrum import MultiKrum
from fedgpu.server.strategies.trimmed_mean import TrimmedMean

# The rows a job file may name (the table's JOB_STRATEGIES); FedBuff, an internal row, is built
# by mode = "async" (server/rounds/buffered.py). tests/unit/test_strategies.py keeps the two
# equal.
STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad, Median,
                              TrimmedMean, Krum, MultiKrum, FedNova)
}


def make_strategy(name: str, params: Mapping[str, Any] | None = None,
                  privacy: PrivacySettings | None = None, rounds: int = 1) -> Strategy:
    """A configured strategy; bad [strategy_params] raise ConfigError naming the key. With
    `privacy`, wrapped in client-level DP (server/strategies/private.py) for `rounds` rounds."""
    cls = STRATEGIES[strategy_spec(name).name]  # an unknown name: ConfigError, nearest named
    if privacy is None:
        return cls(params)
    from fedgpu.server.strategies.private import PrivateStrategy

    return PrivateStrategy(cls(params), privacy, rounds)
