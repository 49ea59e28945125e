"""FedYogi's and FedAdagrad's steps (Reddi et al., "Adaptive Federated Optimization", 2021),
as Flower has them (flwr/serverapp/strategy/fedyogi.py, fedadagrad.py): pure array math
beside aggregate.adam_step. delta = the round's weighted mean - the global model.

    m <- beta_1 m + (1 - beta_1) delta          (FedAdagrad: beta_1 = 0, m = delta)
    Yogi:    v <- v - (1 - beta_2) delta^2 sign(v - delta^2)
    Adagrad: v <- v + delta^2
    x <- x + eta m / (sqrt(v) + tau)

No bias correction, as in the paper and Flower: tau bounds the first steps instead. The
moments start at zero and are updated in place (the caller passes copies, server_opt.py)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedgpu.server.strategies.aggregate import cast_back, pseudo_gradients


def yogi_step(global_weights: Mapping[str, np.ndarray], mean: Mapping[str, np.ndarray],
              m: dict[str, np.ndarray], v: dict[str, np.ndarray], eta: float, beta_1: float,
              beta_2: float, tau: float) -> dict[str, np.ndarray]:
    """FedYogi: Adam's first moment, and a second moment that moves towards delta^2 by at
    most (1 - beta_2) delta^2 per round whichever way (Zaheer et al. 2018)."""
    out: dict[str, np.ndarray] = {}
    for name, g, delta in pseudo_gradients(global_weights, mean, out):
        dt = delta.dtype
        mm = m.setdefault(name, np.zeros(g.shape, dt))
        vv = v.setdefault(name, np.zeros(g.shape, dt))
        mm *= beta_1
        mm += (1 - beta_1) * delta
        sq = np.square(delta)
        vv -= (1 - beta_2) * sq * np.sign(vv - sq)
        out[name] = cast_back(g.astype(dt) + eta * mm / (np.sqrt(vv) + tau), g.dtype)
    return out


def adagrad_step(global_weights: Mapping[str, np.ndarray], mean: Mapping[str, np.ndarray],
                 v: dict[str, np.ndarray], eta: float, tau: float) -> dict[str, np.ndarray]:
    """FedAdagrad: the sum of every round's delta^2 scales this round's delta (Flower fixes
    beta_1 = 0, so its first moment is delta itself and needs no state)."""
    out: dict[str, np.ndarray] = {}
    for name, g, delta in pseudo_gradients(global_weights, mean, out):
        vv = v.setdefault(name, np.zeros(g.shape, delta.dtype))
        vv += np.square(delta)
        out[name] = cast_back(g.astype(delta.dtype) + eta * delta / (np.sqrt(vv) + tau),
                              g.dtype)
    return out
