"""The hyperparameters the built-in tasks declare, with their types (the defaults' types), and the
runner's own: what `job submit` checks a job's `[hyperparameters]` against, so a typo such as
`learning_rate` is refused at once, naming the allowed keys, instead of failing the job on the
nodes later.

A copy: the tasks' DEFAULTS (node/tasks/*.py) and the runner's (node/rounds/switches.py,
node/rounds/dp_sgd.py) live on the node side, which the aggregator never imports (it carries no
torch). tests/unit/test_task_schemas.py fails when a copy here differs from its source. Tasks
that are not built in (installed by a site, or sent as a bundle) are checked by the nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedgpu.core.errors import ConfigError

Default = int | float | bool | str

# For every task (node/rounds/switches.py SWITCH_DEFAULTS, node/rounds/dp_sgd.py DP_DEFAULTS).
RUNNER: dict[str, Default] = {
    "amp": "off", "channels_last": False, "compile": False, "cudnn_benchmark": False,
    "dp_sgd": False, "max_grad_norm": 1.0, "noise_multiplier": 0.0, "dp_target_epsilon": 0.0,
    "dp_rounds": 1, "dp_delta": 1e-5, "dp_accountant": "rdp", "dp_fix_model": False,
}
# For Dataset tasks, whose loop the runner drives (switches.py LOOP_DEFAULTS).
LOOP: dict[str, Default] = {
    "batch_size": 64, "eval_batch_size": 0, "local_epochs": 1, "max_steps": 0,
    "max_train_seconds": 0.0, "round_train_s": 0.0, "num_workers": -1,
}
# Set by the aggregator for jobs with update_codec (node/rounds/compress.py), not by people.
# So are local_params' (node/rounds/local_state.py).
ENGINE_KEYS = ("update_codec", "topk_fraction", "update_codec_run", "local_params",
               "local_params_run")
# task -> (its own DEFAULTS, whether the runner drives its loop).
TASKS: dict[str, tuple[dict[str, Default], bool]] = {
    "digits": ({"lr": 0.05, "momentum": 0.9, "local_epochs": 1, "batch_size": 32,
                "weight_decay": 0.0, "round_train_s": 0.0}, False),
    "images": ({"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0005, "depth": 18, "width": 0,
                "num_classes": 10, "image_size": 32, "augment": True, "crop_padding": 4}, True),
    "causal-lm": ({"model_dir": "", "dtype": "auto", "quantization": "none", "lora_r": 8,
                   "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": "all-linear",
                   "freeze_lora_a": False, "lr": 0.0002, "weight_decay": 0.0, "seq_len": 512,
                   "text_field": "text", "eval_fraction": 0.1,
                   "gradient_checkpointing": False}, True),
}


def allowed(task: str) -> dict[str, Default] | None:
    """Every hyperparameter a job of `task` may set, with its default; None: not built in."""
    if task not in TASKS:
        return None
    own, loop = TASKS[task]
    return {**RUNNER, **(LOOP if loop else {}), **own}


def _kind(default: Default) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, str):
        return "a string"
    return "an integer" if isinstance(default, int) else "a number"


def _fits(value: Any, default: Default) -> bool:
    # As the nodes read them (node/tasks/base.py resolve_hparams): an int is a number, a bool
    # is no int.
    if isinstance(default, bool | str):
        return isinstance(value, type(default))
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if isinstance(default, int) else isinstance(value, int | float)


def check(task: str, given: Mapping[str, Any], source: str = "job") -> None:
    """ConfigError naming an unknown hyperparameter (and the allowed ones) or a value of the
    wrong kind, for a built-in task; nothing for other tasks."""
    schema = allowed(task)
    if schema is None:
        return
    unknown = sorted(k for k in given if k not in schema and k not in ENGINE_KEYS)
    if unknown:
        raise ConfigError(f"{source}: task {task!r} has no hyperparameter(s) "
                          f"{', '.join(unknown)}; allowed: {', '.join(sorted(schema))}")
    for key, value in given.items():
        if key in schema and not _fits(value, schema[key]):
            raise ConfigError(f"{source}: [hyperparameters] {key} of task {task!r} must be "
                              f"{_kind(schema[key])}, got {value!r}")
