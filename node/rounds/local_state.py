"""A site's personalised layers (job key `local_params`, fedgpu/core/local_params.py): the
tensors that never leave it, kept across rounds.

The aggregator asks for them with runner hyperparameters (taken out before the task sees the
rest): `local_params` (the glob patterns) and `local_params_run` (the run the copy belongs
to). Each round the runner loads the global model, puts the site's own copy of the local
tensors over it (none yet: the global model's starting values), trains or evaluates with that
model (so evaluation scores the site's own layers), then saves the local tensors again and
writes only the rest as the update. The copy lives in the node's state directory (the agent
names it in task.json as `local_state_dir`), one safetensors file per run, written atomically,
so a node that restarts resumes with its layers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core import codec, local_params
from fedgpu.core.errors import ConfigError
from fedgpu.node.tasks.base import HyperparameterError

# What task.json calls the folder (the agent's state directory for this site).
TASK_KEY = "local_state_dir"
# The run id names a file: the aggregator's hex id, nothing that could walk out of the folder.
_RUN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class LocalStateError(ValueError):
    """The site's saved layers do not fit the model (another model under the same run)."""


@dataclass(frozen=True)
class LocalAsk:
    patterns: tuple[str, ...]
    run: str


def take(hparams: dict[str, Any]) -> LocalAsk | None:
    """Take the keys out of `hparams` (in place); None when the job keeps nothing local."""
    raw = hparams.pop(local_params.HPARAM, None)
    run = hparams.pop(local_params.RUN_HPARAM, "")
    if raw is None:
        return None
    try:
        patterns = local_params.parse(raw, "hyperparameters")
    except ConfigError as exc:
        raise HyperparameterError(str(exc)) from None
    if not isinstance(run, str) or not _RUN.fullmatch(run):
        raise HyperparameterError(f"hyperparameter {local_params.RUN_HPARAM} must be a run id "
                                  f"(1-64 letters, digits, '-' or '_'), got {str(run)[:80]!r}")
    return LocalAsk(patterns, run) if patterns else None


def path_for(ask: LocalAsk, state_dir: str | None, workdir: Path) -> Path:
    # Without a state directory (a worker started by hand) the copy sits in the work root,
    # beside the rounds' own directories, as the update codec's residual does.
    folder = Path(state_dir) if state_dir else Path(workdir).resolve().parent
    return folder / f"local-params-{ask.run}.safetensors"


def restore(arrays: dict[str, np.ndarray], ask: LocalAsk, path: Path) -> int:
    """Put the site's saved local tensors over the global model's (in place); how many."""
    if not path.exists():
        return 0
    try:
        saved = codec.read_file(path)
    except (OSError, codec.CodecError) as exc:
        raise LocalStateError(f"the site's local layers in {path} cannot be read ({exc}): "
                              "remove the file to start them over from the global model") from None
    for name, value in saved.items():
        have = arrays.get(name)
        if have is None or have.shape != value.shape or not local_params.is_local(
                name, ask.patterns):
            raise LocalStateError(
                f"the site's local layers in {path} do not fit this model (tensor {name!r}): "
                "remove the file to start them over from the global model")
        arrays[name] = value  # in the site's precision: load_into converts it
    return len(saved)


def keep(trained: Mapping[str, np.ndarray], ask: LocalAsk, path: Path,
         metadata: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Save the local tensors of `trained` at the site; the rest (what may leave) back."""
    shared, local = local_params.split(trained, ask.patterns)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    encoded = codec.encode(local, dict(metadata))
    with open(tmp, "wb") as f:
        for segment in encoded.segments:
            f.write(segment)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a crash mid-write leaves the last round's copy whole
    return shared


def patterns_in(hyperparameters_json: str) -> tuple[str, ...]:
    """The local patterns a task header's hyperparameters carry (none: an empty tuple); for
    the secure-aggregation answer, whose masked vector covers the shared tensors only."""
    try:
        hparams = json.loads(hyperparameters_json or "{}")
        raw = hparams.get(local_params.HPARAM) if isinstance(hparams, dict) else None
        return local_params.parse(raw, "hyperparameters") if raw is not None else ()
    except (ValueError, ConfigError):
        return ()  # the round's runner refused them already, with the reason
