"""A built-in task's say in admission: what it needs of this site before its round starts.

The admission rule (fedgpu/core/admission.py) reads the job's `[resources]`; a task that knows
more about its own needs than the job file says — `causal-lm` knows its base model's size and
that the model must be on the site — refines them here, in the agent, from the task's
hyperparameters and the site's data directory. Pure Python: the agent never imports torch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fedgpu.core.job.resources import Resources
from fedgpu.node.policy import Ineligible

log = logging.getLogger("fedgpu.node")


def for_site(task_name: str, hyperparameters_json: str, data_dir: Path, need: Resources,
             bundled: bool = False) -> tuple[Resources, str]:
    """(the needs admission applies, the hyperparameters' JSON for this site's round).

    Raises Ineligible with the reason when the task cannot run on this site. A task without a
    say, a bundle, or hyperparameters that are not a JSON object pass through unchanged (the
    round reports what is wrong with them).
    """
    if bundled or task_name != "causal-lm":
        return need, hyperparameters_json
    try:
        hparams = json.loads(hyperparameters_json or "{}")
    except json.JSONDecodeError:
        return need, hyperparameters_json
    if not isinstance(hparams, dict):
        return need, hyperparameters_json
    from fedgpu.node.tasks.causal_lm.site import SiteRefusal
    from fedgpu.node.tasks.causal_lm.site import for_site as lm_for_site

    try:
        derived, hparams = lm_for_site(hparams, data_dir, need)
    except SiteRefusal as exc:
        raise Ineligible(str(exc)) from None
    if derived != need:
        log.info("causal-lm: admission uses gpu=%s, min_gpu_free_mib=%d, gpu_memory_mib=%s "
                 "(the job gave gpu=%s, %d, %s; GPU memory estimated from the base model)",
                 derived.gpu.value, derived.min_gpu_free_mib, derived.gpu_memory_mib,
                 need.gpu.value, need.min_gpu_free_mib, need.gpu_memory_mib)
    need = derived
    return need, json.dumps(hparams)
