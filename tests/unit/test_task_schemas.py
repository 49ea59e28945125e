"""The aggregator's copy of the built-in tasks' hyperparameters (fedgpu/core/task_schemas.py)
against their sources on the node side, and the check `job submit` makes with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedgpu.core import task_schemas
from fedgpu.core.constants import BUILTIN_TASKS
from fedgpu.core.errors import ConfigError
from fedgpu.server.jobs.queue import JobManager
from fedgpu.server.jobs.store import JobStore
from fedgpu.server.registry import Registry


def test_the_copy_matches_the_nodes_own_defaults() -> None:
    from fedgpu.node.rounds.dp_sgd import DP_DEFAULTS
    from fedgpu.node.rounds.switches import LOOP_DEFAULTS, SWITCH_DEFAULTS
    from fedgpu.node.tasks import digits, images, load_task
    from fedgpu.node.tasks.base import DatasetTask
    from fedgpu.node.tasks.causal_lm import settings

    assert task_schemas.RUNNER == {**SWITCH_DEFAULTS, **DP_DEFAULTS}
    assert task_schemas.LOOP == LOOP_DEFAULTS
    own = {"digits": digits.DEFAULTS, "images": images.DEFAULTS, "causal-lm": settings.DEFAULTS}
    assert set(task_schemas.TASKS) == set(BUILTIN_TASKS) == set(own)
    for name, (defaults, loop) in task_schemas.TASKS.items():
        assert defaults == own[name], name
        assert loop == isinstance(load_task(name), DatasetTask), name


@pytest.mark.parametrize(("hp", "words"), [
    ({"learning_rate": 0.1}, "has no hyperparameter(s) learning_rate; allowed: "),
    ({"lr": "fast"}, "lr of task 'digits' must be a number"),
    ({"local_epochs": 1.5}, "local_epochs of task 'digits' must be an integer"),
    ({"dp_sgd": 1}, "dp_sgd of task 'digits' must be true or false"),
])
def test_a_built_in_tasks_bad_hyperparameter_is_refused_at_submit(tmp_path: Path, hp, words):
    jobs = JobManager(JobStore(tmp_path), Registry(), tmp_path, chunk_size=1 << 20)
    lines = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in hp.items())
    with pytest.raises(ConfigError) as info:
        jobs.intake.submit(f'task = "digits"\n[hyperparameters]\n{lines}\n', "job.toml", "operator")
    assert words in str(info.value)
    assert "lr" in str(info.value) or "must be" in str(info.value)


def test_good_hyperparameters_and_other_tasks_pass() -> None:
    task_schemas.check("digits", {"lr": 1, "batch_size": 8, "dp_sgd": True, "amp": "bf16"})
    task_schemas.check("images", {"num_workers": 2, "depth": 8})
    task_schemas.check("my-own-task", {"anything": 1})  # its nodes check it
