"""A simulated node's personalised layers (job key `local_params`, fedgpu/core/local_params.py):
the tensors matching the job's patterns never leave the node, as on a real site.

The agent's runner keeps them in the node's state directory (node/rounds/local_state.py); a
simulated node keeps them in memory, one copy per run (the aggregator's `local_params_run`),
and only for the run it serves now: a thousand nodes must not each hold every job's layers.
Each training round puts the node's copy over the global model's (none yet: the global
model's starting values), steps every tensor, keeps the local ones and sends the rest.
"""

from __future__ import annotations

import json

import numpy as np

from fedgpu.core import local_params
from fedgpu.core.errors import ConfigError


class BadLocalParams(ValueError):
    """The task's local_params hyperparameters cannot be read (the agent refuses the round)."""


def ask_of(hyperparameters_json: str) -> tuple[tuple[str, ...], str]:
    """(patterns, run) a task asks to keep local; ((), "") when nothing is."""
    try:
        hparams = json.loads(hyperparameters_json or "{}")
    except ValueError as exc:
        raise BadLocalParams(f"hyperparameters are not JSON: {exc}") from None
    if not isinstance(hparams, dict) or hparams.get(local_params.HPARAM) is None:
        return (), ""
    try:
        patterns = local_params.parse(hparams[local_params.HPARAM], "hyperparameters")
    except ConfigError as exc:
        raise BadLocalParams(str(exc)) from None
    return patterns, str(hparams.get(local_params.RUN_HPARAM, ""))


class LocalLayers:
    """One node's own tensors for the run it serves now."""

    def __init__(self) -> None:
        self.run = ""
        self.tensors: dict[str, np.ndarray] = {}

    def restore(self, model: dict[str, np.ndarray], patterns: tuple[str, ...], run: str
                ) -> int:
        """Put the node's copy over `model`'s local tensors (in place); how many."""
        if run != self.run:
            self.run, self.tensors = run, {}
        used = 0
        for name, have in self.tensors.items():
            g = model.get(name)
            if g is not None and g.shape == have.shape and local_params.is_local(name, patterns):
                model[name] = have.astype(g.dtype, copy=False)
                used += 1
        return used

    def keep(self, trained: dict[str, np.ndarray], patterns: tuple[str, ...]
             ) -> dict[str, np.ndarray]:
        """Keep `trained`'s local tensors here; the shared ones (what may leave) back."""
        shared, local = local_params.split(trained, patterns)
        self.tensors = local
        return shared
