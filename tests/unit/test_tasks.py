"""Task lookup through the fedgpu.tasks entry points, and the built-in digits task."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

import fedgpu.node.tasks as tasks
from fedgpu.core.datasets import split_digits
from fedgpu.node.tasks import (
    HyperparameterError,
    Task,
    TaskLoadError,
    UnknownTaskError,
    available_tasks,
    load_task,
)
from fedgpu.node.tasks.digits import DigitsTask

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    # Tiny convolutions run far slower split across threads on a small CI machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def digits_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    (node_dir,) = split_digits(tmp_path_factory.mktemp("digits"), 1)
    return dict(DigitsTask().load_data(node_dir))


def test_digits_is_installed_and_loads() -> None:
    assert "digits" in available_tasks()
    task = load_task("digits")
    assert isinstance(task, DigitsTask) and isinstance(task, Task)
    assert task.name == "digits"


def test_unknown_task_lists_installed_ones_and_how_to_add_one() -> None:
    with pytest.raises(UnknownTaskError) as info:
        load_task("cifar")
    msg = str(info.value)
    assert "unknown task 'cifar'" in msg and "installed tasks: causal-lm, digits, images" in msg
    assert "'fedgpu.tasks' entry-point group" in msg
    assert isinstance(info.value, LookupError)


def _fake_entry_points(module: str, **targets: str) -> Callable[[str], list[EntryPoint]]:
    def entry_points(group: str) -> list[EntryPoint]:
        assert group == "fedgpu.tasks"
        return [EntryPoint(name, f"{module}:{obj}", group) for name, obj in targets.items()]

    return entry_points


class _ThirdPartyTask(DigitsTask):
    name = "third"


def test_third_party_tasks_come_from_the_entry_point_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = types.ModuleType("fedgpu_test_thirdparty")
    module.ThirdTask = _ThirdPartyTask  # type: ignore[attr-defined]
    module.ready = _ThirdPartyTask()  # type: ignore[attr-defined]
    module.NotATask = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(
        tasks,
        "entry_points",
        _fake_entry_points(
            module.__name__, third="ThirdTask", ready="ready", bogus="NotATask", gone="Missing"
        ),
    )
    assert available_tasks() == ["bogus", "causal-lm", "digits", "gone", "images", "ready",
                                 "third"]
    assert load_task("third").name == "third"
    # An entry point may also name an instance rather than a class.
    assert load_task("ready") is module.ready  # type: ignore[attr-defined]
    with pytest.raises(TaskLoadError, match="does not implement a task contract"):
        load_task("bogus")
    with pytest.raises(TaskLoadError, match="'gone' .* failed to load"):
        load_task("gone")


def test_model_shapes() -> None:
    torch.manual_seed(0)
    model = DigitsTask().build_model({})
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {
        "conv1.weight": (16, 1, 3, 3),
        "conv1.bias": (16,),
        "conv2.weight": (32, 16, 3, 3),
        "conv2.bias": (32,),
        "fc1.weight": (64, 512),
        "fc1.bias": (64,),
        "fc2.weight": (10, 64),
        "fc2.bias": (10,),
    }


def test_model_is_built_on_the_ambient_device() -> None:
    # The runner builds under `with torch.device(...)`; the meta device shows it is honoured.
    with torch.device("meta"):
        model = DigitsTask().build_model({})
    assert {p.device.type for p in model.parameters()} == {"meta"}


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        ({"learning_rate": 0.1}, "no hyperparameter(s) learning_rate; known: batch_size"),
        ({"batch_size": 3.5}, "batch_size must be an integer"),
        ({"local_epochs": True}, "local_epochs must be an integer"),
        ({"lr": "fast"}, "lr must be a number"),
        ({"lr": 0}, "lr must be > 0"),
        ({"momentum": -0.1}, "momentum must be >= 0"),
    ],
)
def test_bad_hyperparameters_are_refused(given: dict[str, object], needle: str) -> None:
    with pytest.raises(HyperparameterError) as info:
        DigitsTask().build_model(given)
    assert needle in str(info.value)


def test_integers_are_accepted_for_float_hyperparameters() -> None:
    hp = DigitsTask().hparams({"lr": 1, "weight_decay": 0})
    assert hp["lr"] == 1.0 and isinstance(hp["lr"], float)
    assert hp["batch_size"] == 32 and hp["local_epochs"] == 1 and hp["momentum"] == 0.9


def test_load_data_gives_cpu_tensors(digits_data: dict[str, torch.Tensor]) -> None:
    assert set(digits_data) == {"x_train", "y_train", "x_test", "y_test"}
    assert digits_data["x_train"].dtype == torch.float32
    assert digits_data["y_test"].dtype == torch.int64
    assert all(t.device.type == "cpu" for t in digits_data.values())


def _trained(data: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    task = DigitsTask()
    model = task.build_model({})
    task.train(model, data, CPU, {"local_epochs": 1}, seed)
    return model.state_dict()


def test_training_is_deterministic_given_the_seed(digits_data: dict[str, torch.Tensor]) -> None:
    a, b, c = (_trained(digits_data, s) for s in (1, 1, 2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_train_and_evaluate_report_metrics(digits_data: dict[str, torch.Tensor]) -> None:
    torch.manual_seed(0)
    task = DigitsTask()
    model = task.build_model({})
    n_eval, before = task.evaluate(model, digits_data, CPU, {})
    n, train_metrics = task.train(model, digits_data, CPU, {"local_epochs": 2}, 0)
    _, after = task.evaluate(model, digits_data, CPU, {})
    # Weighted by the local set's size, not by examples seen over several epochs.
    assert n == len(digits_data["y_train"]) and n_eval == len(digits_data["y_test"])
    assert set(train_metrics) == {"loss", "accuracy", "steps", "examples"}
    assert set(after) == {"loss", "accuracy"}
    # Batches of 32, two epochs: what FedNova normalises by.
    assert train_metrics["steps"] == 2 * -(-n // 32) and train_metrics["examples"] == 2 * n
    assert after["accuracy"] > before["accuracy"] + 0.3
    assert after["loss"] < before["loss"]


def test_missing_data_files_are_a_data_dir_error(tmp_path: Path) -> None:
    from fedgpu.node.data import DataDirError

    with pytest.raises(DataDirError, match="cannot read .*train.safetensors"):
        DigitsTask().load_data(tmp_path)
