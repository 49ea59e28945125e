"""The checks of the modes that train nothing: `mode = "evaluate"` scores one model (the job's
`initial_weights`, or the final model of an earlier job: `model_from_job`) on every chosen
site's held-out split, in one round; `mode = "cross-site"` scores the final model of a
training job (`model_from_job`) and each site's last local model of it on every site.

A key that only means something for training (a strategy, a ring's mixing, privacy, ...) is
refused by name when it is set in such a job: a job file that says `strategy = "fedprox"`
and trains nothing is a mistake its author wants to hear about, not a key silently ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fedgpu.core.constants import Mode
from fedgpu.core.errors import ConfigError
from fedgpu.core.hetero_config import HeteroWork
from fedgpu.core.job.schema import Key, combination_rule, key_rule

# Top-level keys that only training reads: set to anything but their default, they are
# refused in an evaluate job.
TRAINING_KEYS: tuple[str, ...] = (
    "strategy", "strategy_params", "fraction", "max_examples_per_node", "mixing",
    "local_steps", "iterations", "ring_timeout_s")


# Each top-level key's default, as declared on Job: handed over by job.py once Job exists
# (job.py imports this module, so this module cannot import job.py).
_DEFAULTS: dict[str, Any] = {}


def declare_defaults(keys: Iterable[Key]) -> None:
    _DEFAULTS.update({k.name: k.default for k in keys})


def _defaults() -> dict[str, Any]:
    assert _DEFAULTS, "job.py declares the keys' defaults when it is imported"
    return _DEFAULTS


# The modes that score models and train nothing.
SCORING_MODES = (Mode.EVALUATE, Mode.CROSS_SITE)


@key_rule
def _evaluate_keys(parsed: dict[str, Any], source: str) -> None:
    mode = parsed["mode"]
    if mode not in SCORING_MODES:
        if parsed["model_from_job"] is not None:
            raise ConfigError(f"{source}: 'model_from_job' names the model an evaluate job "
                              "scores (or the training job a cross-site job compares): it "
                              "needs mode = \"evaluate\" or \"cross-site\" (got mode = "
                              f"{mode!r}); to train from an earlier job's model, "
                              "download it with 'fedgpu job model' and give it as "
                              "'initial_weights'")
        return
    defaults = _defaults()
    if parsed["rounds"] not in (1, defaults["rounds"]):
        what = "runs one round" if mode == Mode.EVALUATE else "trains no rounds"
        raise ConfigError(f"{source}: mode = {mode!r} {what}: leave 'rounds' out (or set "
                          f"it to 1), got {parsed['rounds']!r}")
    parsed["rounds"] = 1
    if not parsed["evaluate"]:
        raise ConfigError(f"{source}: mode = {mode!r} is an evaluation: 'evaluate = "
                          "false' leaves it nothing to do")
    given = [k for k in TRAINING_KEYS if parsed[k] != defaults[k]]
    if parsed.get("local_params"):  # [] as a stored job writes it counts as not given
        given.append("local_params")
    if given:
        raise ConfigError(f"{source}: {', '.join(repr(k) for k in given)} only mean something "
                          f"for training, and mode = {mode!r} trains nothing: leave "
                          f"{'it' if len(given) == 1 else 'them'} out")
    weights, earlier = parsed["initial_weights"], parsed["model_from_job"]
    if mode == Mode.CROSS_SITE:
        if earlier is None:
            raise ConfigError(f"{source}: mode = \"cross-site\" compares the models of a "
                              "training job: set 'model_from_job' to its id (from 'fedgpu job "
                              "list'); its final model and each site's last local model are "
                              "scored on every site")
        if weights is not None:
            raise ConfigError(f"{source}: mode = \"cross-site\" scores the models of job "
                              f"{earlier!r} ('model_from_job'): 'initial_weights' has no "
                              "place in it; to score one file on every site use mode = "
                              "\"evaluate\"")
        return
    if weights is None and earlier is None:
        raise ConfigError(f"{source}: mode = \"evaluate\" scores a given model: set "
                          "'initial_weights' (a safetensors file) or 'model_from_job' (the id "
                          "of an earlier job, whose final model is scored)")
    if weights is not None and earlier is not None:
        raise ConfigError(f"{source}: 'initial_weights' and 'model_from_job' both name the "
                          "model to score: keep one")


@combination_rule
def _evaluate_sections(parsed: dict[str, Any], source: str) -> None:
    mode = parsed["mode"]
    if mode not in SCORING_MODES:
        return
    given = [name for name in ("secure_aggregation", "privacy") if parsed[name] is not None]
    if parsed["hetero"] != HeteroWork():
        given.append("the keys for unlike sites (round_train_s, update_codec, ...)")
    if given:
        raise ConfigError(f"{source}: {', '.join(given)} only apply to training, and mode = "
                          f"{mode!r} trains nothing (no update is uploaded): leave them out")


# job.py imports this module for its registrations.
registered = True
