"""The strategy table: every strategy a job file may name, its parameters and what it can be
combined with. This is the one place that knows strategy names; the job schema checks a job
against it, the aggregator builds strategies from it (server/strategies/ registers one class
per row), and the job-file reference lists it.

Parameter names follow Flower where Flower has the strategy (`eta`, `eta_l`, `beta_1`,
`beta_2`, `tau`, `num_malicious_clients`, `num_clients_to_keep`); an older name of ours is kept
as an alias so stored jobs and existing job files still parse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fedgpu.core.errors import ConfigError
from fedgpu.core.suggest import did_you_mean

Scalar = int | float | str | bool


class UpdateNeed(StrEnum):
    """What a strategy reads from each update besides its tensors."""

    EXAMPLES = "examples"        # the update's example count (weighting)
    LOCAL_STEPS = "local_steps"  # the optimizer steps it took (FedNova's normalisation)
    STALENESS = "staleness"      # model versions since its task (FedBuff's weighting)


@dataclass(frozen=True)
class Param:
    """One `[strategy_params]` key: its type, range, default and a line of doc."""

    name: str
    default: Scalar
    doc: str
    kind: type = float
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    # Older names that mean the same key (stored jobs and job files written before).
    aliases: tuple[str, ...] = ()

    def expected(self) -> str:
        if self.kind is str:
            return "a string"
        what = "an integer" if self.kind is int else "a number"
        if self.lo is None and self.hi is None:
            return what
        left = "(" if self.lo_open else "["
        right = ")" if self.hi_open else "]"
        lo = "-inf" if self.lo is None else f"{self.lo:g}"
        hi = "inf" if self.hi is None else f"{self.hi:g}"
        if self.hi is None and not self.lo_open:
            return f"{what} >= {lo}"
        if self.hi is None:
            return f"{what} > {lo}"
        return f"{what} in {left}{lo}, {hi}{right}"

    def check(self, value: object, where: str) -> Scalar:
        """The value as this parameter's type, or a ConfigError naming the key and range."""
        bad = ConfigError(f"{where}: [strategy_params] {self.name} must be {self.expected()}, "
                          f"got {value!r}")
        if self.kind is str:
            if not isinstance(value, str):
                raise bad
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        if self.kind is int and not isinstance(value, int):
            raise bad
        number = float(value)
        if not math.isfinite(number):
            raise bad
        if self.lo is not None and (number < self.lo or (self.lo_open and number == self.lo)):
            raise bad
        if self.hi is not None and (number > self.hi or (self.hi_open and number == self.hi)):
            raise bad
        return value if self.kind is int else number


@dataclass(frozen=True)
class StrategySpec:
    """A strategy as the job file sees it. Capabilities, not name lists, decide combinations."""

    name: str
    doc: str
    params: tuple[Param, ...] = ()
    # The result is a function of the weighted mean of the updates alone: noise calibrated to
    # the mean protects it (DP), and the sum secure aggregation reveals is enough.
    mean_only: bool = True
    # Why it needs each update on its own (the aggregator never sees one under secure
    # aggregation; a compressed update is not dense); None: the sum will do.
    needs_individual: str | None = None
    needs: frozenset[UpdateNeed] = field(default_factory=lambda: frozenset({UpdateNeed.EXAMPLES}))
    # Chosen by the job's mode, never named in a job file (FedBuff runs mode = "async").
    internal: bool = False

    @property
    def dense_only(self) -> bool:
        return self.needs_individual is not None

    @property
    def secagg_problem(self) -> str | None:
        """Why secure aggregation cannot wrap this strategy, or None."""
        if self.needs_individual is not None:
            return self.needs_individual
        if UpdateNeed.LOCAL_STEPS in self.needs:
            return ("it weighs each update by its own local steps, which secure aggregation "
                    "keeps from the aggregator")
        return None

    @property
    def dp_ok(self) -> bool:
        return self.mean_only

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name or name in p.aliases:
                return p
        raise KeyError(name)

    def defaults(self) -> dict[str, Scalar]:
        return {p.name: p.default for p in self.params}

    def parse_params(self, raw: Mapping[str, Any], where: str = "job") -> dict[str, Scalar]:
        """`[strategy_params]` checked against this row: unknown keys refused with the nearest
        known one, aliases mapped to their Flower name, defaults filled in."""
        out = self.defaults()
        seen: dict[str, str] = {}
        for key, value in raw.items():
            try:
                p = self.param(key)
            except KeyError:
                names = [q.name for q in self.params]
                hint = did_you_mean(key, names + [a for q in self.params for a in q.aliases])
                allowed = ", ".join(names) or "none"
                raise ConfigError(f"{where}: [strategy_params] {key} not understood by "
                                  f"strategy {self.name!r}{hint} (allowed: {allowed})") from None
            if p.name in seen:
                raise ConfigError(f"{where}: [strategy_params] {key} and {seen[p.name]} are the "
                                  f"same parameter of strategy {self.name!r}; give one")
            seen[p.name] = key
            out[p.name] = p.check(value, where)
        return out


_POSITIVE = {"lo": 0.0, "lo_open": True}
_UNIT = {"lo": 0.0, "hi": 1.0, "hi_open": True}
_SPILL = (
    Param("memory_budget_mib", 256, "updates held in memory before they spill to disk (MiB)",
          kind=int, lo=1),
    Param("spill_dir", "", "where spilled updates go (default: the state directory)", kind=str),
)
_INDIVIDUAL = ("it needs every site's update on its own, and secure aggregation only "
               "reveals their sum")


def _server_opt(name: str, doc: str, *, eta: float, eta_l: float, beta_1: float | None,
                beta_2: float | None, tau: float, aliases: bool = False) -> StrategySpec:
    params = [Param("eta", eta, "server learning rate", **_POSITIVE),
              Param("eta_l", eta_l, "client learning rate (recorded, as in Flower; the task's "
                    "own hyperparameters set it)", **_POSITIVE)]
    if beta_1 is not None:
        params.append(Param("beta_1", beta_1, "first-moment decay", **_UNIT,
                            aliases=("beta1",) if aliases else ()))
    if beta_2 is not None:
        params.append(Param("beta_2", beta_2, "second-moment decay", **_UNIT,
                            aliases=("beta2",) if aliases else ()))
    params.append(Param("tau", tau, "adaptivity (added to the root of the second moment)",
                        **_POSITIVE))
    return StrategySpec(name, doc, tuple(params))


def _krum(name: str, doc: str, *, keep: int, keep_doc: str) -> StrategySpec:
    # Flower's newer API (flwr.serverapp.strategy) names the same two num_malicious_nodes and
    # num_nodes_to_select: accepted as aliases.
    return StrategySpec(name, doc, (
        Param("num_malicious_clients", 0, "sites assumed hostile (f): each update is scored "
              "by its K - f - 2 nearest others", kind=int, lo=0,
              aliases=("num_malicious_nodes",)),
        Param("num_clients_to_keep", keep, keep_doc, kind=int, lo=keep,
              aliases=("num_nodes_to_select",)),
        *_SPILL,
    ), mean_only=False, needs_individual=_INDIVIDUAL)


_ROWS: tuple[StrategySpec, ...] = (
    StrategySpec("fedavg", "weighted mean of the updates by examples (McMahan et al. 2017)"),
    StrategySpec("fedavgm", "FedAvg with server momentum (Hsu et al. 2019)", (
        Param("server_lr", 1.0, "server learning rate", **_POSITIVE),
        Param("momentum", 0.9, "server momentum", **_UNIT),
    )),
    _server_opt("fedadam", "FedAvg's mean as a pseudo-gradient for Adam (Reddi et al. 2021)",
                eta=0.01, eta_l=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3, aliases=True),
    # fedyogi and fedadagrad: Flower's defaults (flwr.serverapp.strategy FedYogi, FedAdagrad;
    # Flower's older flwr.server.strategy.FedAdagrad had tau = 1e-9).
    _server_opt("fedyogi", "FedAvg's mean as a pseudo-gradient for Yogi (Reddi et al. 2021)",
                eta=0.01, eta_l=0.0316, beta_1=0.9, beta_2=0.99, tau=1e-3),
    _server_opt("fedadagrad", "FedAvg's mean as a pseudo-gradient for Adagrad (Reddi et al. "
                "2021)", eta=0.1, eta_l=0.1, beta_1=None, beta_2=None, tau=1e-3),
    StrategySpec("median", "coordinate-wise median (Yin et al. 2018)", _SPILL,
                 mean_only=False, needs_individual=_INDIVIDUAL),
    StrategySpec("trimmed_mean", "coordinate-wise trimmed mean (Yin et al. 2018)", (
        Param("trim", 0.1, "fraction cut from each end", lo=0.0, hi=0.5, hi_open=True),
        *_SPILL,
    ), mean_only=False, needs_individual=_INDIVIDUAL),
    _krum("krum", "the update closest to its neighbours (Blanchard et al. 2017)", keep=0,
          keep_doc="0: the single best update; else the mean of that many best (Multi-Krum)"),
    _krum("multikrum", "the mean of the updates closest to their neighbours (Blanchard et "
          "al. 2017)", keep=1, keep_doc="updates averaged, best first (1, Flower's default: "
          "Krum)"),
    StrategySpec("fednova", "normalised averaging for unequal local steps (Wang et al. 2020)", (
        Param("local_momentum", 0.0, "the sites' optimizer momentum", **_UNIT),
        Param("server_lr", 1.0, "server learning rate", **_POSITIVE),
        Param("max_factor", 1.0, "cap on the step factor (1: no extrapolation past the sites' "
              "models)", lo=1.0),
    ), mean_only=False,
        needs=frozenset({UpdateNeed.EXAMPLES, UpdateNeed.LOCAL_STEPS})),
    StrategySpec("fedbuff", "staleness-weighted FedAvg of a buffer (Nguyen et al. 2022); "
                 "mode = \"async\" runs it", mean_only=False,
                 needs=frozenset({UpdateNeed.EXAMPLES, UpdateNeed.STALENESS}), internal=True),
    StrategySpec("ring", "the uniform mean of the ring's copies (D-PSGD's output); mode = "
                 "\"ring\" runs it", mean_only=False, internal=True),
)

STRATEGY_SPECS: dict[str, StrategySpec] = {row.name: row for row in _ROWS}
# What a job file's `strategy` may name.
JOB_STRATEGIES: tuple[str, ...] = tuple(r.name for r in _ROWS if not r.internal)


def strategy_spec(name: str, where: str = "job") -> StrategySpec:
    """The row for a job file's `strategy`, or a ConfigError with the nearest known name."""
    spec = STRATEGY_SPECS.get(name)
    if spec is None or spec.internal:
        raise ConfigError(f"{where}: unknown strategy {name!r}{did_you_mean(name, JOB_STRATEGIES)}"
                          f"; known: {', '.join(JOB_STRATEGIES)}")
    return spec
