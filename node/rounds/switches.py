"""The runner's own hyperparameters: GPU switches for every task, the loop for Dataset tasks.

A job's `[hyperparameters]` table holds both the task's (lr, width, ...) and these; the runner
takes its keys out before the task sees the rest, so a task's strict check of its own keys
(`resolve_hparams`) keeps refusing typos. What does not apply on the round's device is turned
off with one log line instead of failing the round: a job is written once for sites with and
without GPUs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from fedgpu.node.tasks.base import HyperparameterError, resolve_hparams

log = logging.getLogger("fedgpu.worker")


class Amp(StrEnum):
    """Mixed precision of the forward pass: bfloat16, float16 (with a GradScaler), or none."""

    BF16 = "bf16"
    FP16 = "fp16"
    OFF = "off"


# For every task: the runner applies them around the task's model, whoever owns the loop.
SWITCH_DEFAULTS: dict[str, int | float | bool | str] = {
    "amp": Amp.OFF.value,
    "channels_last": False,
    "compile": False,
    # Off by default: cuDNN's autotuner picks kernels by timing, so results vary run to run.
    "cudnn_benchmark": False,
}
# Only for Dataset tasks, whose loop the runner drives. A tensor task keeps its own batch_size
# and local_epochs, which it validates itself.
LOOP_DEFAULTS: dict[str, int | float | bool | str] = {
    "batch_size": 64,
    "eval_batch_size": 0,  # 0: twice batch_size (no activations are kept for backward)
    "local_epochs": 1,
    "max_steps": 0,  # 0: no cap; else the round stops after this many optimizer steps
    "max_train_seconds": 0.0,  # 0: no cap; else the round stops after the step that crosses it
    # Set by jobs with local_work = "time": train (epoch after epoch) until this many seconds
    # are spent, whatever local_epochs says. 0: off.
    "round_train_s": 0.0,
    "num_workers": -1,  # -1: 0 on the CPU (training needs the cores), up to 8 on a GPU
}
# DataLoader worker processes beyond this rarely help a single GPU and each costs host memory.
_MAX_AUTO_WORKERS = 8


@dataclass(frozen=True)
class Switches:
    amp: Amp = Amp.OFF
    channels_last: bool = False
    compile: bool = False
    cudnn_benchmark: bool = False


@dataclass(frozen=True)
class LoopSettings:
    batch_size: int = 64
    eval_batch_size: int = 128
    local_epochs: int = 1
    max_steps: int = 0
    max_train_seconds: float = 0.0
    num_workers: int = 0
    round_train_s: float = 0.0


def split_hparams(
    task_name: str, given: Mapping[str, Any], streaming: bool
) -> tuple[Switches, LoopSettings | None, dict[str, Any]]:
    """(switches, loop settings for a Dataset task else None, the task's own hyperparameters)."""
    ours = dict(SWITCH_DEFAULTS, **(LOOP_DEFAULTS if streaming else {}))
    picked = {k: v for k, v in given.items() if k in ours}
    rest = {k: v for k, v in given.items() if k not in ours}
    hp = resolve_hparams(task_name, picked, ours)
    try:
        amp = Amp(hp["amp"])
    except ValueError:
        raise HyperparameterError(
            f"task {task_name!r}: hyperparameter amp must be one of "
            f"{', '.join(a.value for a in Amp)}, got {hp['amp']!r}"
        ) from None
    switches = Switches(amp, hp["channels_last"], hp["compile"], hp["cudnn_benchmark"])
    if not streaming:
        return switches, None, rest
    for key in ("batch_size", "local_epochs"):
        if hp[key] < 1:
            _refuse(task_name, key, hp[key], ">= 1")
    for key in ("eval_batch_size", "max_steps", "max_train_seconds", "round_train_s"):
        if hp[key] < 0:
            _refuse(task_name, key, hp[key], ">= 0")
    if hp["num_workers"] < -1:
        _refuse(task_name, "num_workers", hp["num_workers"], ">= 0, or -1 for automatic")
    loop = LoopSettings(
        batch_size=hp["batch_size"],
        eval_batch_size=hp["eval_batch_size"] or 2 * hp["batch_size"],
        local_epochs=hp["local_epochs"],
        max_steps=hp["max_steps"],
        max_train_seconds=hp["max_train_seconds"],
        num_workers=hp["num_workers"],
        round_train_s=float(hp["round_train_s"]),
    )
    return switches, loop, rest


def for_device(
    task_name: str, switches: Switches, device_type: str, owns_loop: bool
) -> Switches:
    """The switches that apply on `device_type`; each one dropped is logged with why."""
    out = switches
    if switches.amp is Amp.FP16 and device_type != "cuda":
        log.info("amp=fp16 ignored on %s: float16 needs a CUDA GradScaler; training in float32 "
                 "(amp=bf16 works on the CPU)", device_type)
        out = replace(out, amp=Amp.OFF)
    elif switches.amp is Amp.FP16 and not owns_loop:
        log.info("amp=fp16 ignored: task %r runs its own training loop, where the runner cannot "
                 "put the GradScaler float16 needs; training in float32 (amp=bf16 applies)",
                 task_name)
        out = replace(out, amp=Amp.OFF)
    if switches.cudnn_benchmark and device_type != "cuda":
        log.info("cudnn_benchmark ignored on %s: there is no cuDNN", device_type)
        out = replace(out, cudnn_benchmark=False)
    return out


def workers_for(loop: LoopSettings, device_type: str) -> int:
    """DataLoader worker processes: as asked, or automatic (-1)."""
    if loop.num_workers >= 0:
        return loop.num_workers
    if device_type != "cuda":
        return 0
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    # One core stays with the training process, which feeds the GPU.
    return max(0, min(_MAX_AUTO_WORKERS, cpus - 1))


def _refuse(task_name: str, key: str, value: object, expected: str) -> None:
    raise HyperparameterError(
        f"task {task_name!r}: hyperparameter {key} must be {expected}, got {value}"
    )
