"""Task lookup by name through the `fedgpu.tasks` entry-point group.

Importing this package does not import torch: the agent lists tasks without paying for it, and
only `load_task` imports the task's module.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from fedgpu.core.errors import FedgpuError
from fedgpu.node.tasks.base import Datasets, DatasetTask, HyperparameterError, Task

__all__ = [
    "ENTRY_POINT_GROUP",
    "DatasetTask",
    "Datasets",
    "HyperparameterError",
    "Task",
    "TaskLoadError",
    "UnknownTaskError",
    "available_tasks",
    "load_task",
]

ENTRY_POINT_GROUP = "fedgpu.tasks"
# The built-ins, as pyproject declares them; used when the package runs from a source tree that
# was never installed (so no entry-point metadata exists), e.g. PYTHONPATH=. in a container.
_BUILTIN = {
    "digits": "fedgpu.node.tasks.digits:DigitsTask",
    "images": "fedgpu.node.tasks.images:ImagesTask",
    "causal-lm": "fedgpu.node.tasks.causal_lm.task:CausalLmTask",
}


class UnknownTaskError(FedgpuError, LookupError):
    exit_code = 2


class TaskLoadError(FedgpuError, RuntimeError):
    """The task is registered but its code failed to import or to construct."""


def _registered() -> dict[str, str]:
    found = dict(_BUILTIN)
    found.update({ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)})
    return found


def available_tasks() -> list[str]:
    return sorted(_registered())


def load_task(name: str) -> Task | DatasetTask:
    registered = _registered()
    if name not in registered:
        raise UnknownTaskError(
            f"unknown task {name!r}; installed tasks: {', '.join(sorted(registered)) or 'none'}. "
            f"To add one, install a package that declares it under the {ENTRY_POINT_GROUP!r} "
            f"entry-point group, e.g. in its pyproject.toml: "
            f'[project.entry-points."{ENTRY_POINT_GROUP}"] {name} = "mypkg.tasks:MyTask"'
        )
    target = registered[name]
    try:
        obj = EntryPoint(name=name, value=target, group=ENTRY_POINT_GROUP).load()
        # An entry point may name a class (instantiated here) or a ready task object.
        task = obj() if isinstance(obj, type) else obj
    except Exception as exc:
        raise TaskLoadError(f"task {name!r} ({target}) failed to load: {exc}") from exc
    # The streaming contract is checked first: a Dataset task may also carry a tensor-style
    # method or two, and load_datasets is what makes the runner drive its loop.
    if not isinstance(task, DatasetTask | Task):
        raise TaskLoadError(
            f"task {name!r} ({target}) does not implement a task contract (tensors: name, "
            f"build_model, load_data, train, evaluate; or Datasets: name, build_model, "
            f"load_datasets, optimizer, batch_loss; see node/tasks/base.py)"
        )
    return task

