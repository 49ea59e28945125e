"""Pure arithmetic for unlike sites: FedNova's normalised averaging and FedBuff's staleness
weights. Numbers in, numbers out; the strategies and the round engine apply them.

FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS 2020). Site i ran tau_i local steps; with plain SGD its
cumulative update is a sum of tau_i gradients, with momentum rho each gradient counts
(1 - rho^(steps left)) / (1 - rho) times, in all

    a_i = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho)        (a_i = tau_i at rho = 0)

FedAvg's mean of the deltas weights a site by p_i * a_i (p_i = n_i / n, its data share), so a
site that ran 5x the steps pulls the model 5x as hard toward its own objective. FedNova
averages the normalised deltas instead and rescales by tau_eff = sum p_i a_i:

    x_new = x + tau_eff * sum_i p_i (x_i - x) / a_i

With omega_i = n_i / a_i this is the omega-weighted mean M of the x_i (what WeightedSum
computes as the updates stream in), moved away from x by the factor

    F = (sum n_i a_i) (sum n_i / a_i) / n^2 >= 1       (Cauchy-Schwarz; 1 when all a_i agree)

    x_new = x + F * (M - x)

so FedNova is FedAvg when every site ran the same number of steps.

FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS
2022). An update trained on the model of version v arrives when the model is at version V:
its staleness is s = V - v. It is weighted by staleness_weight(s) = 1 / sqrt(1 + s) (the
paper's choice: s = 3 halves it, s = 8 thirds it) and refused past `max_staleness`. A buffer
of K updates moves the model by

    x_new = x + server_lr * sum_i n_i w(s_i) (x_i - x) / sum_i n_i

(an omega-weighted mean with omega_i = n_i w(s_i), times sum omega / sum n), so stale updates
pull less and a buffer of fresh ones is exactly FedAvg of the buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fedgpu.core.hetero_config import StalenessWeighting


def local_steps_norm(steps: float, momentum: float = 0.0) -> float:
    """a_i: how many gradients a site's cumulative update adds up (|a_i|_1 in the paper)."""
    if not (steps > 0 and math.isfinite(steps)):
        raise ValueError(f"local steps must be positive, got {steps}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if momentum == 0.0:
        return float(steps)
    rho = momentum
    return (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho)


def fednova_weight(num_examples: float, a: float) -> float:
    """omega_i = n_i / a_i: each site's weight in the mean M."""
    return num_examples / a


def fednova_factor(num_examples: Sequence[float], norms: Sequence[float]) -> float:
    """F = (sum n_i a_i)(sum n_i / a_i) / n^2, the step from x to M scaled to FedNova's."""
    if not num_examples or len(num_examples) != len(norms):
        raise ValueError("one local-steps norm per update, at least one update")
    n = math.fsum(num_examples)
    # Normalised first: n_i a_i alone can be large (1e15 examples x 1e6 steps).
    tau_eff = math.fsum(ni / n * a for ni, a in zip(num_examples, norms, strict=True))
    inv = math.fsum(ni / n / a for ni, a in zip(num_examples, norms, strict=True))
    return tau_eff * inv


def staleness_weight(staleness: int, kind: StalenessWeighting = StalenessWeighting.SQRT,
                     exponent: float = 1.0) -> float:
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if kind is StalenessWeighting.SQRT:
        return 1.0 / math.sqrt(1.0 + staleness)
    if kind is StalenessWeighting.POLY:
        return (1.0 + staleness) ** -exponent
    return 1.0


def staleness_refusal(staleness: int, max_staleness: int) -> str | None:
    """The reason an update is refused for being stale, or None when it may be used."""
    if staleness > max_staleness:
        return (f"update trained on a model {staleness} versions old; the job's "
                f"max_staleness is {max_staleness}")
    return None


def buffer_factor(num_examples: Sequence[float], weights: Sequence[float]) -> float:
    """sum n_i w_i / sum n_i: the omega-weighted mean's step scaled to FedBuff's."""
    n = math.fsum(num_examples)
    if not num_examples or n <= 0:
        raise ValueError("at least one update with examples")
    return math.fsum(ni / n * w for ni, w in zip(num_examples, weights, strict=True))
