"""The runner's training and evaluation loops for Dataset tasks (node/tasks/base.py DatasetTask).

The runner owns everything between the Dataset and the task's `batch_loss`: DataLoaders (batch
size, worker processes kept for the whole round, pinned host memory on CUDA), the move of each
batch to the device (`non_blocking` from pinned memory, channels_last for image batches),
autocast, the GradScaler float16 needs, and the step itself. Losses and counts are summed on
the device: a `.item()` per step would make the host wait for the GPU every batch.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from fedgpu.node.rounds.switches import Amp, LoopSettings, Switches, workers_for
from fedgpu.node.tasks.base import DatasetTask, Metrics

if TYPE_CHECKING:
    from fedgpu.node.rounds.ddp import Ddp
    from fedgpu.node.rounds.dp_sgd import PrivateTraining

_AUTOCAST_DTYPES = {Amp.BF16: torch.bfloat16, Amp.FP16: torch.float16}


class BatchError(TypeError):
    """A batch the runner cannot move to the device, or a batch_loss it cannot use."""


@dataclass
class TrainOutcome:
    num_examples: int
    metrics: Metrics = field(default_factory=dict)
    seconds: float = 0.0


def make_loader(
    ds: Dataset[Any], batch_size: int, *, train: bool, seed: int, workers: int,
    device: torch.device,
) -> DataLoader[Any]:
    n = len(ds)  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    if workers > 0:
        # Kept across the round's epochs: re-forking the workers each epoch costs a stall.
        kwargs["persistent_workers"] = train
    return DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=train,
        # The shuffle order and every worker's seed derive from this generator, so a round's
        # batches depend on the round's seed alone (for a given num_workers).
        generator=torch.Generator().manual_seed(seed) if train else None,
        num_workers=workers,
        # Pinned pages let the host-to-device copy run asynchronously (non_blocking below).
        pin_memory=device.type == "cuda",
        # A last batch of 1 breaks BatchNorm in training and makes torch.compile recompile.
        drop_last=train and n > batch_size,
        **kwargs,
    )


def autocast(device: torch.device, switches: Switches) -> contextlib.AbstractContextManager[Any]:
    dtype = _AUTOCAST_DTYPES.get(switches.amp)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def move(batch: Any, device: torch.device, non_blocking: bool, channels_last: bool) -> Any:
    """Tensors, and tuples, lists and dicts of them, onto `device`."""
    if isinstance(batch, torch.Tensor):
        if channels_last and batch.dim() == 4:
            return batch.to(device, non_blocking=non_blocking, memory_format=torch.channels_last)
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: move(v, device, non_blocking, channels_last) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(move(v, device, non_blocking, channels_last) for v in batch)
    raise BatchError(
        f"a batch of type {type(batch).__name__} cannot be moved by the runner: yield tensors "
        f"(or tuples, lists, dicts of them) from the Dataset, or define "
        f"move_batch(batch, device, non_blocking) on the task"
    )


def batch_len(batch: Any) -> int:
    """Examples in a batch: the first dimension of its first tensor."""
    for t in _tensors(batch):
        return int(t.shape[0]) if t.dim() else 1
    raise BatchError("a batch holds no tensor, so the runner cannot count its examples")


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, tuple | list):
        for v in batch:
            yield from _tensors(v)
    else:
        # A custom batch type (the task's move_batch handles it): look at its fields.
        yield from _tensors(list(getattr(batch, "__dict__", {}).values()))


class Loop:
    """One round's loops over a Dataset task, with its switches applied."""

    def __init__(self, task: DatasetTask, model: torch.nn.Module, device: torch.device,
                 loop: LoopSettings, switches: Switches, task_hparams: Mapping[str, Any],
                 private: PrivateTraining | None = None, ddp: Ddp | None = None) -> None:
        self.task = task
        # Data-parallel workers (node/rounds/ddp.py): this rank trains on its slice of each
        # global batch of `loop.batch_size`.
        self.ddp = ddp
        self.model = model
        self.device = device
        self.loop = loop
        self.switches = switches
        self.hparams = task_hparams
        # DP-SGD (node/rounds/dp_sgd.py): Opacus wraps the model, optimizer and loader of train().
        self.private = private
        self.workers = workers_for(loop, device.type)
        # The compiled module shares the model's parameters; weights are read from `model`.
        self.forward_model: torch.nn.Module = (
            torch.compile(model) if switches.compile else model  # type: ignore[assignment]
        )
        self._non_blocking = device.type == "cuda"
        custom = getattr(task, "move_batch", None)
        self._move = (
            (lambda b: custom(b, device, self._non_blocking)) if callable(custom)
            else (lambda b: move(b, device, self._non_blocking, switches.channels_last))
        )

    def evaluate(self, ds: Dataset[Any]) -> tuple[int, Metrics]:
        # No more worker processes than batches: a small held-out set is one batch or two.
        batches = -(-len(ds) // self.loop.eval_batch_size)  # type: ignore[arg-type]
        loader = make_loader(ds, self.loop.eval_batch_size, train=False, seed=0,
                             workers=min(self.workers, batches), device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.int64)
        seen, counted = 0, False
        self.model.eval()
        with torch.no_grad():
            for raw in loader:
                batch = self._move(raw)
                n = batch_len(batch)
                with autocast(self.device, self.switches):
                    loss, right = self._split(self.task.batch_loss(self.forward_model, batch))
                loss_sum += loss.detach().float() * n
                if right is not None:
                    correct += right
                    counted = True
                seen += n
        del loader
        return seen, self._metrics(loss_sum, correct if counted else None, seen)

    def train(self, ds: Dataset[Any], seed: int, round_started: float) -> TrainOutcome:
        """Train in place; `round_started` (perf_counter) dates the first-step figure."""
        loop, device = self.loop, self.device
        opt = self.task.optimizer(self.model, self.hparams)
        scaler = torch.amp.GradScaler("cuda") if self.switches.amp is Amp.FP16 else None
        shards = None
        if self.ddp is not None:
            from fedgpu.node.rounds import ddp as data_parallel

            gen = torch.Generator().manual_seed(seed)
            shards = data_parallel.sharded_batches(ds, loop.batch_size, gen, self.ddp,
                                                   drop_last=len(ds) > loop.batch_size)  # type: ignore[arg-type]
            loader: DataLoader[Any] = DataLoader(
                ds, batch_sampler=shards, generator=gen, num_workers=self.workers,
                pin_memory=device.type == "cuda",
                persistent_workers=self.workers > 0)
            wrapped = data_parallel.wrap(self.model, device)
            forward = torch.compile(wrapped) if self.switches.compile else wrapped  # type: ignore[assignment]
        else:
            loader = make_loader(ds, loop.batch_size, train=True, seed=seed,
                                 workers=self.workers, device=device)
            forward = self.forward_model
        if self.private is not None:
            forward, opt, loader = self.private.wrap(self.model, opt, loader, loop.local_epochs,
                                                     loop.max_steps)
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.int64)
        seen = steps = 0
        counted = False
        first_step_s = 0.0
        start = time.perf_counter()
        # A time budget (local_work = "time") trains epoch after epoch until it is spent.
        limit = loop.round_train_s or loop.max_train_seconds
        deadline = start + limit if limit > 0 else None
        epochs = itertools.count() if loop.round_train_s > 0 else range(loop.local_epochs)
        self.model.train()
        stop = False
        for _ in epochs:
            before = steps
            for raw in loader:
                batch = self._move(raw)
                n = batch_len(batch)
                with autocast(device, self.switches):
                    loss, right = self._split(self.task.batch_loss(forward, batch))
                opt.zero_grad(set_to_none=True)
                step_loss = loss
                if shards is not None:
                    assert self.ddp is not None
                    step_loss = loss * data_parallel.loss_weight(n, shards.global_size,
                                                                 self.ddp)
                if scaler is not None:
                    scaler.scale(step_loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    step_loss.backward()
                    opt.step()
                if n:  # a Poisson-sampled batch (DP-SGD) may be empty: its mean loss is NaN
                    loss_sum += loss.detach().float() * n
                if right is not None:
                    correct += right
                    counted = True
                seen += n
                steps += 1
                if steps == 1:
                    self._sync()  # once: the figure must include the kernels, not their launch
                    first_step_s = time.perf_counter() - round_started
                stop = bool(loop.max_steps and steps >= loop.max_steps) or (
                    deadline is not None and time.perf_counter() >= deadline)
                if shards is not None and deadline is not None:
                    # Ranks must stop at the same step, or the others wait in a collective.
                    stop = data_parallel.any_rank(stop, device)
                if stop:
                    break
            # An epoch without a step (no batches) would spin forever under a time budget.
            if stop or steps == before:
                break
        self._sync()
        seconds = time.perf_counter() - start
        del loader  # ends the persistent workers now, not at interpreter exit
        metrics = self._metrics(loss_sum, correct if counted else None, seen)
        # steps: what FedNova normalises by; examples: what this site's data did this round.
        metrics.update(steps=float(steps), examples=float(seen),
                       examples_per_s=round(seen / max(seconds, 1e-9), 1),
                       first_step_s=round(first_step_s, 4))
        if self.private is not None:
            metrics.update(self.private.finish())
        # FedAvg weighs an update by the local set's size, not by the examples seen in it.
        return TrainOutcome(len(ds), metrics, round(seconds, 4))  # type: ignore[arg-type]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _split(self, out: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(out, torch.Tensor):
            return out, None
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor):
            return out[0], out[1]
        raise BatchError(
            f"task {self.task.name!r}: batch_loss must return the mean loss (a tensor) or "
            f"(mean loss, number right), got {type(out).__name__}"
        )

    @staticmethod
    def _metrics(loss_sum: torch.Tensor, correct: torch.Tensor | None, seen: int) -> Metrics:
        out = {"loss": float(loss_sum) / max(seen, 1)}
        if correct is not None:
            out["accuracy"] = float(correct) / max(seen, 1)
        return out
