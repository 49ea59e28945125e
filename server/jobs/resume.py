"""May this state directory be resumed by this job? Pure: the job and the checkpoint in, a
ConfigError naming the mismatch out. Resuming another job's checkpoint would silently train
the wrong model (or crash on the first update), so anything that defines the model or how it
is combined must match; what only paces the run (rounds, deadlines, hyperparameters) may
change between restarts and is merely logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core import codec
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Job, resume_keys

log = logging.getLogger("fedgpu.server.jobs.resume")

# Declared on each key (`resume=True` in fedgpu/core/job/job.py), listed on the reference page.
MUST_MATCH = resume_keys()


def _same(saved: Any, value: Any) -> bool:
    # A tuple key (local_params) is a JSON list in state.json, and absent from a checkpoint
    # written before the key existed: that run kept nothing local.
    if isinstance(value, tuple):
        return isinstance(saved, list | tuple | None) and tuple(saved or ()) == value
    return bool(saved == value)


def check(job: Job, weights: Mapping[str, np.ndarray], state: Mapping[str, Any],
          initial_weights: Mapping[str, np.ndarray] | None, state_dir: Path) -> None:
    saved = state.get("job")
    if not isinstance(saved, dict) or "run_id" not in state or "global_round" not in state:
        raise ConfigError(f"{state_dir}/state.json is not a fedgpu checkpoint; point "
                          "--state-dir at an empty directory to start a fresh run")
    fix = (f"use the job file that run {state['run_id']} was started with, or a fresh "
           "--state-dir for a new run")
    for key in MUST_MATCH:
        if not _same(saved.get(key), getattr(job, key)):
            raise ConfigError(
                f"--state-dir {state_dir} holds run {state['run_id']} with {key} = "
                f"{saved.get(key)!r}, but this job has {key} = {getattr(job, key)!r}: {fix}")
    if initial_weights is not None and codec.spec(initial_weights) != codec.spec(weights):
        raise ConfigError(
            f"--state-dir {state_dir} holds a model whose tensor names, shapes or dtypes differ "
            f"from this job's initial_weights: {fix}")
    finished = int(state["global_round"])
    if finished > job.rounds:
        raise ConfigError(
            f"--state-dir {state_dir} holds run {state['run_id']} after round {finished}, but "
            f"this job asks for only {job.rounds} rounds: raise 'rounds' or use a fresh "
            "--state-dir")
    changed = sorted(k for k, v in job.to_dict().items()
                     if k not in MUST_MATCH and saved.get(k, v) != v)
    if changed:
        log.warning("resuming run %s with a changed job: %s", state["run_id"], ", ".join(changed))
