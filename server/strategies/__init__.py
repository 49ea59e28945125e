"""Strategies by name, as the job file's `strategy` key names them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from server.strategies.base import Strategy
from server.strategies.fedavg import FedAvg

STRATEGIES: dict[str, type[Strategy]] = {FedAvg.name: FedAvg}


def make_strategy(name: str, params: Mapping[str, Any] | None = None) -> Strategy:
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None
    return cls(params)
