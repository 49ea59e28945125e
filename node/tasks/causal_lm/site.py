"""What a site must have for a `causal-lm` task, decided by the agent before a round starts.

Pure Python (no torch, no transformers): the agent answers "ineligible: <reason>" at once when
the base model's directory is not on this site, when 4/8-bit loading is asked of a site without
bitsandbytes, or when no GPU can hold the estimated memory of the round (memory.py) — instead of
spawning a worker that would fail minutes later. It also rewrites a relative `model_dir` to the
absolute path on this site (resolved against the node's data directory), so the round's worker,
which knows no data directory when it builds the model, reads the same directory.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedgpu.core.constants import GpuNeed
from fedgpu.core.job.resources import Resources
from fedgpu.node.rounds.switches import LOOP_DEFAULTS
from fedgpu.node.tasks.base import HyperparameterError
from fedgpu.node.tasks.causal_lm import memory
from fedgpu.node.tasks.causal_lm.settings import DEFAULTS, Quantization, parse


class SiteRefusal(Exception):
    """This site cannot take the task; the message is the reason the aggregator shows."""


def resolve_model_dir(model_dir: str, data_dir: Path) -> Path:
    path = Path(model_dir).expanduser()
    return path if path.is_absolute() else (Path(data_dir) / path).resolve()


def for_site(hparams: Mapping[str, Any], data_dir: Path, need: Resources
             ) -> tuple[Resources, dict[str, Any]]:
    """(the job's needs with GPU memory derived when not given, hyperparameters for this site).

    Raises SiteRefusal with the reason when this site cannot take the task at all. Bad
    hyperparameters are not refused here: the round reports them as a failed task, the way
    every other task's are.
    """
    given = dict(hparams)
    raw_dir = given.get("model_dir", DEFAULTS["model_dir"])
    if not isinstance(raw_dir, str) or not raw_dir.strip():
        return need, given
    model_dir = resolve_model_dir(raw_dir, data_dir)
    if not model_dir.is_dir():
        raise SiteRefusal(f"the base model directory {model_dir} (model_dir = {raw_dir!r}) is "
                          f"not on this site")
    given["model_dir"] = str(model_dir)
    own = {k: v for k, v in given.items() if k in DEFAULTS}
    try:
        settings = parse(own)
    except HyperparameterError:
        return need, given
    if settings.quantization is not Quantization.NONE:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise SiteRefusal(f"quantization = {settings.quantization.value!r} loads the base "
                              f"model with bitsandbytes, which this site has not installed")
        if need.gpu is GpuNeed.NONE:
            raise SiteRefusal(f"quantization = {settings.quantization.value!r} needs a CUDA GPU "
                              f"and the job uses none (gpu = \"none\")")
        # 4/8-bit kernels are CUDA only: the CPU fallback of gpu = "preferred" cannot run it.
        need = replace(need, gpu=GpuNeed.REQUIRED)
    if need.gpu is GpuNeed.NONE or need.gpu_memory_mib is not None:
        return need, given
    try:
        facts = memory.model_facts(model_dir)
    except memory.ModelDirError as exc:
        raise SiteRefusal(str(exc)) from None
    batch = given.get("batch_size", LOOP_DEFAULTS["batch_size"])
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        return need, given
    est = memory.estimate(facts, settings, batch)
    # The estimate becomes the job's own figures: a GPU must have it free to be chosen, and
    # the round is capped at it (like gpu_memory_mib in the job file).
    return replace(need, min_gpu_free_mib=max(need.min_gpu_free_mib, est.total_mib),
                   gpu_memory_mib=est.total_mib), given
