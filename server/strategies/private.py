"""Client-level differential privacy around a FedAvg-family strategy (the job's `[privacy]`).

- central: each update is clipped against the global model as it streams in (its L2 norm over
  all floating-point tensors at most the clip), every node counts the same (weight 1: a node's
  influence on the mean must be bounded by the clip, not by the examples it claims), and
  Gaussian noise of std `z * C / m` is added to the mean of the m clipped updates before the
  server optimiser (FedAvgM, FedAdam) reads it. With adaptive clipping the clip follows the
  target quantile of the norms (Andrew et al. 2021) and the noised clipped-count takes its part
  of the noise: the update's multiplier is z_update with 1/z^2 = 1/z_update^2 + 1/(2 sigma_b)^2.
- local: the nodes clipped and noised their own updates (node/rounds/local_dp.py); this side only
  accounts, with the replace-one-node sensitivity 2C (the multiplier counted is z / 2).
- distributed: under secure aggregation each site clipped its update, weighed 1 and added a
  share N(0, z^2 C^2 / n_min) of the noise (fedgpu/core/secagg/noise_share.py); the one update
  this side gets is the unmasked mean of m >= n_min of them, whose sum carries noise of std
  sqrt(m / n_min) z C >= z C. Nothing is added here; each round is accounted as the Gaussian
  mechanism of multiplier z, like central mode (the plan tells `secure_sum` n_min and m).

Every round is accounted with sampling rate 1: the sample is drawn with the job's seed, which is
no secret, so no amplification by sampling is claimed. The account (one (q, z) pair per round)
and the adaptive clip are part of the strategy's checkpointed state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fedgpu.core.errors import ConfigError
from fedgpu.core.job.strategies import JOB_STRATEGIES, STRATEGY_SPECS, UpdateNeed
from fedgpu.core.privacy import PrivacyMode, PrivacySettings
from fedgpu.core.privacy.mechanisms import (
    AdaptiveClip,
    add_gaussian_noise,
    clip_local,
    noise_generator,
    update_noise_multiplier,
)
from fedgpu.core.privacy.settings import budget_spent
from fedgpu.server.strategies.base import Strategy, Weights
from fedgpu.server.strategies.fedavg import FedAvg
from fedgpu.server.strategies.update import UpdateIn

if TYPE_CHECKING:
    from fedgpu.core.privacy.accountant import Accountant

# Rounds are accounted as if every node took part: see the module's docstring.
SAMPLING_RATE = 1.0


def noise_multiplier_for(privacy: PrivacySettings, rounds: int) -> float:
    """The job's noise multiplier: as given, or the smallest that keeps `rounds` rounds within
    target_epsilon (in local mode twice the accounted one, see the module's docstring)."""
    if privacy.noise_multiplier is not None:
        return privacy.noise_multiplier
    assert privacy.target_epsilon is not None, "parse_privacy requires one of the two"
    from fedgpu.core.privacy.accountant import noise_for_budget

    z = noise_for_budget(privacy.target_epsilon, privacy.delta, SAMPLING_RATE, rounds,
                         privacy.accountant)
    return 2 * z if privacy.mode is PrivacyMode.LOCAL else z


def sum_noise_std(noise_multiplier: float, clip_norm: float, min_sites: int, sites: int
                  ) -> float:
    """Distributed mode: the std of the noise on the sum of `sites` shares made for n_min =
    `min_sites`: sqrt(sites / min_sites) * z * C."""
    return (sites / min_sites) ** 0.5 * noise_multiplier * clip_norm


class PrivateStrategy(Strategy):
    name = "private"

    def __init__(self, inner: Strategy, privacy: PrivacySettings, rounds: int) -> None:
        # Not a row of the strategy table: it wraps one, and its updates carry what the
        # inner row asks for. No [strategy_params] of its own. Central mode weighs every
        # update 1 instead of its examples, so the row must need nothing else.
        if not (inner.spec.dp_ok and isinstance(inner, FedAvg)
                and inner.needs == {UpdateNeed.EXAMPLES}):
            ok = [n for n in JOB_STRATEGIES if STRATEGY_SPECS[n].dp_ok]
            raise ConfigError(
                f"job: [privacy] needs a strategy that averages ({', '.join(ok)}), "
                f"not {inner.name!r}: the noise is calibrated to the mean of clipped updates")
        self.spec = inner.spec
        self.params = {}
        self.inner = inner
        self.privacy = privacy
        self.central = privacy.mode is PrivacyMode.CENTRAL
        self.distributed = privacy.mode is PrivacyMode.DISTRIBUTED
        # dp-accounting (scipy) is imported by a job with [privacy] only: seconds of start-up
        # an aggregator without one does not pay.
        from fedgpu.core.privacy.accountant import Accountant

        self.noise_multiplier = noise_multiplier_for(privacy, rounds)
        self.accountant: Accountant = Accountant(privacy.delta, privacy.accountant)
        self.clip_norm = privacy.clip_norm
        self._rng = noise_generator()
        self._global: Mapping[str, np.ndarray] | None = None
        self._norms: list[float] = []
        self._noise_std = 0.0
        self._report: dict[str, Any] | None = None
        # Distributed mode: the round's n_min (secure-aggregation threshold) and summed sites.
        self._secure_sum: tuple[int, int] | None = None
        if self.central:
            inner.mean_hook = self._noise_the_mean

    @property
    def accounted_multiplier(self) -> float:
        """The multiplier of the mechanism the accountant composes, per round."""
        if self.privacy.mode is PrivacyMode.LOCAL:
            return self.noise_multiplier / 2
        # Central, and distributed: the sum of m >= n_min shares has noise std >= z * C.
        return self.noise_multiplier

    def _count_stddev(self, m: int) -> float:
        # Andrew et al. take m / 20; at least z here, so that a small federation's count
        # takes at most a quarter of the noise budget instead of all of it.
        given = self.privacy.clipped_count_stddev
        return given if given is not None else max(m / 20.0, self.noise_multiplier)

    def update_multiplier(self, m: int) -> float:
        """The multiplier of the noise on the mean of m clipped updates."""
        if not self.privacy.adaptive_clip:
            return self.noise_multiplier
        return update_noise_multiplier(self.noise_multiplier, self._count_stddev(m))

    # ---- the Strategy interface ------------------------------------------------------------

    def begin_round(self, global_weights: Mapping[str, np.ndarray]) -> None:
        self._global = global_weights
        self._norms = []
        self._report = None
        self._secure_sum = None
        self.inner.begin_round(global_weights)

    def secure_sum(self, min_sites: int, sites: int) -> None:
        """Distributed mode: the round's unmasked sum held `sites` shares made for n_min =
        `min_sites` (its secure-aggregation threshold); shown in the round's report."""
        if sites < min_sites:
            # The sites' and the aggregator's threshold checks make this impossible; were it
            # to happen, the noise would be below what is accounted.
            raise ValueError(f"a secure sum of {sites} inputs, fewer than n_min = {min_sites}")
        self._secure_sum = (min_sites, sites)

    def add(self, update: UpdateIn) -> None:
        if not self.central:
            # Already clipped and noised by the node: weighting by examples is post-processing.
            self.inner.add(update)
            return
        assert self._global is not None, "begin_round first"
        clipped, norm = clip_local(update.tensors, self._global, self.clip_norm)
        self._norms.append(norm)
        self.inner.add(UpdateIn(clipped, 1))

    def _noise_the_mean(self, mean: Weights) -> Weights:
        m = len(self._norms)
        self._noise_std = self.update_multiplier(m) * self.clip_norm / max(m, 1)
        # The mean is the accumulator's own fresh arrays: noised where they are.
        return add_gaussian_noise(mean, self._noise_std, self._rng, inplace=True)

    def finish(self) -> Weights:
        return self.inner.finish()

    def pending_problem(self) -> str | None:
        return self.inner.pending_problem()

    def commit(self) -> None:
        self.inner.commit()
        epsilon = self.accountant.record(SAMPLING_RATE, self.accounted_multiplier)
        report: dict[str, Any] = {
            "mode": str(self.privacy.mode),
            "epsilon": round(epsilon, 6),
            "delta": self.privacy.delta,
            "noise_multiplier": round(self.noise_multiplier, 6),
            "clip_norm": round(self.clip_norm, 6),
        }
        if self.distributed and self._secure_sum is not None:
            n_min, m = self._secure_sum
            z, c = self.noise_multiplier, self.clip_norm
            report.update(updates=m, min_sites=n_min,
                          share_std=round(z * c / n_min ** 0.5, 9),
                          noise_std=round(sum_noise_std(z, c, n_min, m) / m, 9))
        if self.central:
            # No exact count of clipped updates: it is a statistic of the sites' norms that
            # no noise protects. Adaptive clipping publishes its noised count, the one the
            # account pays for.
            report.update(updates=len(self._norms), noise_std=round(self._noise_std, 9))
            if self.privacy.adaptive_clip and self._norms:
                clip = AdaptiveClip(self.clip_norm, self.privacy.target_quantile,
                                    self.privacy.clip_learning_rate,
                                    self._count_stddev(len(self._norms))
                                    ).next(self._norms, self._rng)
                self.clip_norm = clip.clip_norm
                assert clip.noised_unclipped is not None
                report["unclipped_noised"] = round(clip.noised_unclipped, 3)
                report["next_clip_norm"] = round(self.clip_norm, 6)
        self._report = report

    def round_report(self) -> dict[str, Any] | None:
        return self._report

    def exhausted(self) -> str | None:
        target = self.privacy.target_epsilon
        if target is None:
            return None
        if self.accountant.would_exceed(target, SAMPLING_RATE, self.accounted_multiplier):
            return budget_spent(self.accountant.rounds, self.accountant.epsilon, target)
        return None

    def state(self) -> dict[str, Any]:
        return {"inner": self.inner.state(),
                "privacy": {"events": self.accountant.to_list(), "clip_norm": self.clip_norm,
                            "noise_multiplier": self.noise_multiplier}}

    def tensor_state(self) -> dict[str, np.ndarray]:
        return self.inner.tensor_state()

    def load_state(self, state: Mapping[str, Any],
                   tensors: Mapping[str, np.ndarray] | None = None) -> None:
        self.inner.load_state(state.get("inner") or {}, tensors)
        saved = state.get("privacy") or {}
        self.accountant = type(self.accountant).from_list(
            saved.get("events") or [], self.privacy.delta, self.privacy.accountant)
        self.clip_norm = float(saved.get("clip_norm", self.clip_norm))
        # The noise the account was made with, even if calibrated again differently now.
        self.noise_multiplier = float(saved.get("noise_multiplier", self.noise_multiplier))

    def spent(self) -> float:
        return self.accountant.epsilon
