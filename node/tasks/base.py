"""The task contracts: what a built-in or third-party task implements to train on a node.

A task is found by name through the `fedgpu.tasks` entry-point group, so the aggregator only ever
sends a name, hyperparameters and weights — never code. Two contracts, and the runner
(node/rounds/runner.py) owns the device in both: it builds the model under `torch.device(device)`
and
loads the global weights onto it; task code never calls `.cuda()` or `.to()` on models or data.

- `Task` (tensors): `load_data` returns the node's whole split as CPU tensors, the runner moves
  them to the device once, and the task's own `train`/`evaluate` loop over them. Fits data that
  fits in (GPU) memory, such as digits.
- `DatasetTask` (streaming): `load_datasets` returns torch `Dataset`s and the runner owns the
  loop (node/rounds/loop.py): it builds the DataLoaders (batch size, workers, pinned memory), hands
  each batch to `batch_loss` already on the device, and applies the GPU switches (mixed
  precision, channels_last, torch.compile). A task whose batches are not tensors, tuples, lists
  or dicts of tensors defines `move_batch(batch, device, non_blocking)` and does the move there:
  the one place task code may call `.to()`.

Optional: `eval_metrics(metrics) -> metrics` (Dataset tasks) adds figures derived from the
evaluation's (causal-lm: perplexity from the loss), and `warm_up(hparams)` replaces the worker
factory's throw-away step on the task's model with something cheaper (causal-lm: imports and the
tokenizer, never a CPU copy of a multi-gigabyte base model).

Optional for `mode = "statistics"`: `statistics(data_dir, hparams) -> [(ColumnSpec, values)]`,
the columns a site describes (node/rounds/site_statistics.py states the contract).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

Metrics = dict[str, float]


class HyperparameterError(ValueError):
    """A hyperparameter the task does not know, or a value it cannot use."""


@runtime_checkable
class Task(Protocol):
    name: str

    def build_model(self, hparams: Mapping[str, Any]) -> torch.nn.Module:
        """A freshly initialised model; called under `torch.device(device)` and a fixed seed."""
        ...

    def load_data(self, data_dir: Path) -> Mapping[str, torch.Tensor]:
        """This node's train and held-out tensors, on the CPU."""
        ...

    def train(
        self,
        model: torch.nn.Module,
        data: Mapping[str, torch.Tensor],
        device: torch.device,
        hparams: Mapping[str, Any],
        seed: int,
    ) -> tuple[int, Metrics]:
        """Train in place; return (examples used for weighting, metrics such as loss)."""
        ...

    def evaluate(
        self,
        model: torch.nn.Module,
        data: Mapping[str, torch.Tensor],
        device: torch.device,
        hparams: Mapping[str, Any],
    ) -> tuple[int, Metrics]:
        """Score on the held-out split; classification tasks report "loss" and "accuracy"."""
        ...


@dataclass(frozen=True)
class Datasets:
    """A streaming task's data: this node's training set and its held-out set."""

    train: Dataset[Any]
    test: Dataset[Any]


@runtime_checkable
class DatasetTask(Protocol):
    """A task whose data streams from Datasets; the runner drives its training loop.

    The runner takes its own hyperparameters out of the job's (batch_size, local_epochs,
    max_steps, num_workers, amp, ... — see node/rounds/switches.py) and passes the rest to the task.
    """

    name: str

    def build_model(self, hparams: Mapping[str, Any]) -> torch.nn.Module:
        """A freshly initialised model; called under `torch.device(device)` and a fixed seed."""
        ...

    def load_datasets(self, data_dir: Path, hparams: Mapping[str, Any]) -> Datasets:
        """This node's train and held-out map-style Datasets (`__len__`, `__getitem__`); items
        are read lazily, on the CPU, in the DataLoader's worker processes when it has some."""
        ...

    def optimizer(self, model: torch.nn.Module, hparams: Mapping[str, Any]
                  ) -> torch.optim.Optimizer:
        ...

    def batch_loss(self, model: torch.nn.Module, batch: Any
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Mean loss of one batch (already on the device), or (mean loss, number right).

        Called under the runner's autocast, in train mode for training and under no_grad in
        eval mode for evaluation; "accuracy" is reported when the number right is given.
        """
        ...


def resolve_hparams(
    task_name: str, given: Mapping[str, Any], defaults: Mapping[str, int | float | bool | str]
) -> dict[str, Any]:
    """Defaults overlaid with `given`, refusing unknown keys and values of the wrong kind.

    Strict because a typo such as `learning_rate` for `lr` would otherwise train silently with
    the default and look like a bad model rather than a bad job file.
    """
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise HyperparameterError(
            f"task {task_name!r} has no hyperparameter(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(defaults))}"
        )
    resolved: dict[str, Any] = dict(defaults)
    for key, value in given.items():
        default = defaults[key]
        if isinstance(default, bool | str):
            if not isinstance(value, type(default)):
                kind = "true or false" if isinstance(default, bool) else "a string"
                raise HyperparameterError(
                    f"task {task_name!r}: hyperparameter {key} must be {kind}, got {value!r}"
                )
            resolved[key] = value
            continue
        # bool is an int in Python; `local_epochs = true` is a mistake, not 1.
        ok = not isinstance(value, bool) and (
            isinstance(value, int) if isinstance(default, int) else isinstance(value, int | float)
        )
        if not ok:
            kind = "an integer" if isinstance(default, int) else "a number"
            raise HyperparameterError(
                f"task {task_name!r}: hyperparameter {key} must be {kind}, got {value!r}"
            )
        resolved[key] = type(default)(value)
    return resolved


@runtime_checkable
class RingTask(Task, Protocol):
    """What ring mode (D-PSGD) needs on top of a Task: one gradient step at a time.

    D-PSGD averages the parameters with the ring neighbours *between* computing a gradient and
    applying it, so the worker drives the loop itself: it picks the batch indices, asks the
    task for the batch's loss, gossips, then steps the task's optimizer.
    """

    def optimizer(self, model: torch.nn.Module, hparams: Mapping[str, Any]
                  ) -> torch.optim.Optimizer:
        ...

    def batch_size(self, hparams: Mapping[str, Any]) -> int:
        ...

    def train_size(self, data: Mapping[str, torch.Tensor]) -> int:
        ...

    def batch_loss(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                   idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean loss over training rows `idx` (for backward) and the number predicted right."""
        ...
