"""Krum and Multi-Krum's arithmetic (Blanchard et al. 2017), as Flower computes it
(flwr/serverapp/strategy/strategy_utils.py select_multikrum, flwr/server/strategy/
aggregate.py aggregate_krum): pure array math beside aggregate.py.

Each update's score is the sum of its squared L2 distances (over every tensor, flattened) to
its K - f - 2 nearest other updates (at least 1), f the sites assumed hostile; the updates of
lowest score are kept. Distances need every pair of updates, so they are summed slice by slice
over the spilled updates into a K x K Gram matrix (server/strategies/krum.py): memory K^2
plus one slice, never K models.
"""

from __future__ import annotations

import numpy as np


def add_gram(gram: np.ndarray, block: np.ndarray, base: np.ndarray) -> None:
    """gram += (block - base) (block - base)^T in float64, for one (K, n) slice of the updates
    and the same slice of the global model: the distances are the same from any origin, and
    from the model the updates are small, so |x_i|^2 + |x_j|^2 - 2 x_i.x_j loses few digits."""
    centred = block.astype(np.float64)
    centred -= base.astype(np.float64, copy=False)
    gram += centred @ centred.T


def squared_distances(gram: np.ndarray) -> np.ndarray:
    """The K x K squared distances |x_i - x_j|^2 from the Gram matrix of the x_i."""
    norms = np.diag(gram)
    dist = norms[:, None] + norms[None, :] - 2.0 * gram
    np.maximum(dist, 0.0, out=dist)  # rounding must not make a distance negative
    np.fill_diagonal(dist, 0.0)
    return dist


def krum_scores(dist: np.ndarray, num_malicious: int) -> np.ndarray:
    """Each update's sum of distances to its max(1, K - f - 2) nearest others. Flower sorts
    each row and skips its first entry (the update itself, at distance 0)."""
    k = dist.shape[0]
    closest = max(1, k - num_malicious - 2)
    return np.sort(dist, axis=1)[:, 1 : closest + 1].sum(axis=1)


def krum_select(scores: np.ndarray, keep: int) -> np.ndarray:
    """The indices of the `keep` lowest scores (all of them if keep >= K), best first."""
    return np.argsort(scores, kind="stable")[:max(1, keep)]


def selected_mean_weights(num_examples: np.ndarray, selected: np.ndarray) -> np.ndarray:
    """Per update: its weight in the mean of the selected ones, by examples as Flower weighs
    them (0 for the others)."""
    w = np.zeros(len(num_examples))
    w[selected] = num_examples[selected]
    return w / w.sum()
