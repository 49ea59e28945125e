"""The runner's loop for Dataset tasks (fedgpu.node.rounds.loop) and its switches
(fedgpu.node.rounds.switches).

A small recording task stands in for a real one: it is a real DatasetTask whose batch_loss
notes what the runner handed it (device, memory layout, autocast dtype, which DataLoader worker
made the batch), so each test asserts what the runner did, not what a task reports.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from fedgpu.node.rounds import runner
from fedgpu.node.rounds.loop import BatchError, Loop, batch_len, move
from fedgpu.node.rounds.switches import (
    Amp,
    LoopSettings,
    Switches,
    for_device,
    split_hparams,
    workers_for,
)
from fedgpu.node.tasks import Datasets, DatasetTask, HyperparameterError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Noise(Dataset[tuple[torch.Tensor, int, int]]):
    """Random images (drawn from torch's generator, as augmentation is) and who drew them."""

    def __init__(self, n: int, delay_s: float = 0.0) -> None:
        self.n = n
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.rand(3, 4, 4), i % 3, os.getpid()


@dataclass
class Seen:
    device: str
    channels_last: bool
    dtype: torch.dtype
    pids: list[int]
    first_pixel: list[float]
    training: bool


@dataclass
class Recorder:
    name: str = "recorder"
    seen: list[Seen] = field(default_factory=list)
    returns: str = "pair"

    def build_model(self, hparams: Any) -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(64, 3))

    def load_datasets(self, data_dir: Path, hparams: Any) -> Datasets:
        return Datasets(Noise(24), Noise(10))

    def optimizer(self, model: nn.Module, hparams: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def batch_loss(self, model: nn.Module, batch: Any) -> Any:
        x, y, pid = batch
        logits = model(x)
        self.seen.append(Seen(
            x.device.type, x.is_contiguous(memory_format=torch.channels_last), logits.dtype,
            pid.tolist(), x[:, 0, 0, 0].float().tolist(), model.training))
        loss = F.cross_entropy(logits.float(), y)
        if self.returns == "loss":
            return loss
        if self.returns == "bad":
            return {"loss": loss}
        return loss, (logits.argmax(1) == y).sum()


def _loop(task: Recorder, device: str = "cpu", switches: Switches | None = None,
          **settings: Any) -> Loop:
    torch.manual_seed(0)
    dev = torch.device(device)
    with dev:
        model = task.build_model({})
    settings = {"batch_size": 8, "num_workers": 0, **settings}
    return Loop(task, model, dev, LoopSettings(**settings), switches or Switches(), {})


def test_the_recorder_is_a_dataset_task() -> None:
    assert isinstance(Recorder(), DatasetTask)


@pytest.mark.parametrize("device", DEVICES)
def test_batches_arrive_on_the_device_and_metrics_add_up(device: str) -> None:
    task = Recorder()
    loop = _loop(task, device, local_epochs=2)
    out = loop.train(Noise(24), seed=0, round_started=time.perf_counter())
    assert {s.device for s in task.seen} == {device}
    assert all(s.training for s in task.seen)
    # 24 examples in batches of 8, twice; weighted by the set's size, not examples seen.
    assert out.num_examples == 24 and out.metrics["steps"] == 6
    assert set(out.metrics) == {"loss", "accuracy", "steps", "examples", "examples_per_s",
                                "first_step_s"}
    assert out.metrics["examples"] == 48
    assert 0 <= out.metrics["accuracy"] <= 1 and out.metrics["examples_per_s"] > 0
    assert 0 < out.metrics["first_step_s"] and out.seconds > 0
    task.seen.clear()
    n, metrics = loop.evaluate(Noise(10))
    assert n == 10 and set(metrics) == {"loss", "accuracy"}
    assert not any(s.training for s in task.seen)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_and_channels_last_reach_the_task(device: str) -> None:
    task = Recorder()
    _loop(task, device, Switches(amp=Amp.BF16, channels_last=True)).train(
        Noise(16), 0, time.perf_counter())
    assert {s.dtype for s in task.seen} == {torch.bfloat16}
    assert all(s.channels_last for s in task.seen)
    task.seen.clear()
    _loop(task, device).train(Noise(16), 0, time.perf_counter())
    assert {s.dtype for s in task.seen} == {torch.float32}
    assert not any(s.channels_last for s in task.seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="float16 + GradScaler needs CUDA")
def test_fp16_trains_with_a_grad_scaler_on_cuda() -> None:
    task = Recorder()
    out = _loop(task, "cuda", Switches(amp=Amp.FP16)).train(Noise(16), 0, time.perf_counter())
    assert {s.dtype for s in task.seen} == {torch.float16}
    assert torch.isfinite(torch.tensor(out.metrics["loss"]))


def test_workers_are_kept_across_the_epochs_of_a_round() -> None:
    task = Recorder()
    _loop(task, num_workers=2, local_epochs=3).train(Noise(24), 0, time.perf_counter())
    per_epoch = [{p for s in task.seen[i:i + 3] for p in s.pids} for i in (0, 3, 6)]
    assert os.getpid() not in per_epoch[0] and len(per_epoch[0]) == 2
    assert per_epoch[0] == per_epoch[1] == per_epoch[2]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_batches_depend_on_the_seed_alone(workers: int) -> None:
    def pixels(seed: int) -> list[list[float]]:
        task = Recorder()
        # The global generator is what the runner seeds per round; with no workers the
        # Dataset draws from it, with workers each is seeded from the loader's generator.
        torch.manual_seed(seed)
        loop = _loop(task, num_workers=workers)
        torch.manual_seed(seed)
        loop.train(Noise(24), seed, time.perf_counter())
        return [s.first_pixel for s in task.seen]

    assert pixels(7) == pixels(7) != pixels(8)


def test_max_steps_and_max_train_seconds_end_the_round_early() -> None:
    task = Recorder()
    out = _loop(task, local_epochs=100, max_steps=5).train(Noise(24), 0, time.perf_counter())
    assert out.metrics["steps"] == 5 == len(task.seen)
    task.seen.clear()
    out = _loop(task, local_epochs=100, max_train_seconds=0.2).train(
        Noise(24, delay_s=0.01), 0, time.perf_counter())
    # Each batch takes >= 0.08 s to load: the cap ends the round after a handful of steps.
    assert 1 <= out.metrics["steps"] <= 6 < 300


def test_a_loss_only_task_reports_no_accuracy() -> None:
    out = _loop(Recorder(returns="loss")).train(Noise(16), 0, time.perf_counter())
    assert "accuracy" not in out.metrics and "loss" in out.metrics


def test_a_batch_loss_of_another_shape_is_refused_by_name() -> None:
    with pytest.raises(BatchError, match="recorder.*batch_loss must return the mean loss"):
        _loop(Recorder(returns="bad")).train(Noise(16), 0, time.perf_counter())


@dataclass
class Pair:
    """A batch type the runner does not know: the task moves it itself."""

    x: torch.Tensor
    y: torch.Tensor


class PairTask(Recorder):
    def __init__(self) -> None:
        super().__init__(name="pairs")
        self.moves = 0

    def load_datasets(self, data_dir: Path, hparams: Any) -> Datasets:
        raise AssertionError("not used")

    def move_batch(self, batch: Any, device: torch.device, non_blocking: bool) -> Pair:
        self.moves += 1
        x, y, _ = batch
        return Pair(x.to(device, non_blocking=non_blocking), y.to(device))

    def batch_loss(self, model: nn.Module, batch: Any) -> Any:
        assert isinstance(batch, Pair)
        return F.cross_entropy(model(batch.x), batch.y)


def test_a_task_with_its_own_batch_type_moves_it_through_the_hook() -> None:
    task = PairTask()
    out = _loop(task).train(Noise(16), 0, time.perf_counter())
    assert task.moves == 2 and out.metrics["steps"] == 2


def test_batches_the_runner_cannot_move_are_refused_with_the_fix() -> None:
    with pytest.raises(BatchError, match="define move_batch"):
        move(Pair(torch.zeros(2), torch.zeros(2)), torch.device("cpu"), False, False)
    assert batch_len({"a": (torch.zeros(5, 2), torch.zeros(5))}) == 5
    assert batch_len(Pair(torch.zeros(3, 1), torch.zeros(3))) == 3
    with pytest.raises(BatchError, match="holds no tensor"):
        batch_len(("a", 1))


def test_compile_wraps_the_model_and_shares_its_parameters() -> None:
    # Compiling takes over 30 s on a small CPU, so this checks the wrapping only; the GPU
    # tests (tests/gpu) train a compiled round.
    loop = _loop(Recorder(), switches=Switches(compile=True))
    assert loop.forward_model is not loop.model
    assert isinstance(loop.forward_model, torch._dynamo.eval_frame.OptimizedModule)
    assert list(loop.forward_model.parameters())[0] is list(loop.model.parameters())[0]


class Broken(Dataset[Any]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        from fedgpu.node.data import DataDirError

        raise DataDirError(f"cannot decode image /data/train/cat/{i}.png: truncated")


def test_a_worker_error_reaches_the_agent_as_its_own_one_line() -> None:
    with pytest.raises(Exception) as info:
        _loop(Recorder(), num_workers=1).train(Broken(), 0, time.perf_counter())
    failure = runner.classify(info.value)
    assert failure.kind == "bad_input"
    assert failure.message.startswith("cannot decode image /data/train/cat/")
    assert failure.message.endswith("truncated (in a DataLoader worker)")


# ---- switches ---------------------------------------------------------------------------


def test_split_takes_the_runner_keys_out_of_the_task_hyperparameters() -> None:
    given = {"lr": 0.1, "amp": "bf16", "channels_last": True, "batch_size": 16,
             "local_epochs": 2, "num_workers": 3, "max_steps": 7}
    sw, loop, rest = split_hparams("t", given, streaming=True)
    assert sw == Switches(amp=Amp.BF16, channels_last=True)
    assert loop == LoopSettings(batch_size=16, eval_batch_size=32, local_epochs=2, max_steps=7,
                                num_workers=3)
    assert rest == {"lr": 0.1}
    # A tensor task owns its loop: batch_size and local_epochs stay its own to validate.
    sw, loop, rest = split_hparams("t", given, streaming=False)
    assert loop is None and rest == {"lr": 0.1, "batch_size": 16, "local_epochs": 2,
                                     "num_workers": 3, "max_steps": 7}


@pytest.mark.parametrize(("given", "needle"), [
    ({"amp": "fp8"}, "amp must be one of bf16, fp16, off, got 'fp8'"),
    ({"amp": True}, "amp must be a string"),
    ({"channels_last": 1}, "channels_last must be true or false"),
    ({"compile": "yes"}, "compile must be true or false"),
    ({"batch_size": 0}, "batch_size must be >= 1"),
    ({"max_train_seconds": -1}, "max_train_seconds must be >= 0"),
    ({"num_workers": -2}, "num_workers must be >= 0, or -1 for automatic"),
])
def test_bad_switch_values_are_refused_with_the_key(given: dict[str, Any], needle: str) -> None:
    with pytest.raises(HyperparameterError) as info:
        split_hparams("images", given, streaming=True)
    assert needle in str(info.value) and "'images'" in str(info.value)


def test_what_does_not_apply_on_the_cpu_is_dropped_with_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    asked = Switches(amp=Amp.FP16, channels_last=True, compile=True, cudnn_benchmark=True)
    with caplog.at_level(logging.INFO, logger="fedgpu.worker"):
        got = for_device("t", asked, "cpu", owns_loop=True)
    assert got == Switches(amp=Amp.OFF, channels_last=True, compile=True)
    assert "amp=fp16 ignored on cpu" in caplog.text and "cudnn_benchmark ignored" in caplog.text
    assert for_device("t", Switches(amp=Amp.BF16), "cpu", owns_loop=False).amp is Amp.BF16
    # On CUDA, float16 needs the runner's loop for its GradScaler.
    assert for_device("t", asked, "cuda", owns_loop=True) == asked
    assert for_device("t", asked, "cuda", owns_loop=False).amp is Amp.OFF


def test_automatic_workers_leave_the_cpu_to_training() -> None:
    auto = LoopSettings(num_workers=-1)
    assert workers_for(auto, "cpu") == 0
    assert 0 <= workers_for(auto, "cuda") <= 8
    assert workers_for(LoopSettings(num_workers=3), "cpu") == 3
