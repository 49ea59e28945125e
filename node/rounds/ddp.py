"""Data-parallel rounds: one worker process per device, trained as one model with
torch.distributed DistributedDataParallel (NCCL on CUDA, gloo on the CPU).

The agent (node/rounds/process.py) starts N workers of the same round; each reads the `ddp`
section of its task.json (rank, world size, rendezvous). Equivalence with one worker is the
design rule: every rank draws the one-worker loader's shuffled global batches from the same
seeded generator and trains on its slice of each, the loss is weighted by the slice's share of
the global batch (DDP averages gradients over ranks), and BatchNorm normalises with the
statistics of the whole global batch (`sync_batchnorm`). The same seed and global batch size
then give the same model as one worker, within float tolerance. Rank 0 alone evaluates and
writes the update; every rank's counts and losses are summed into its metrics.
"""

from __future__ import annotations

import datetime
import gc
import inspect
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import BatchSampler, RandomSampler, Sampler

SECTION = "ddp"
# How long a rank waits for the others at the rendezvous and in each collective: a rank that
# died makes the others fail within this, not hang (the agent also kills them as one).
COLLECTIVE_TIMEOUT_S = 300.0


class DdpError(ValueError):
    """The task.json's ddp section, or a task that cannot be trained data-parallel."""


@dataclass(frozen=True)
class Ddp:
    rank: int
    world_size: int
    init_method: str  # tcp://127.0.0.1:PORT, chosen by the agent

    @property
    def leader(self) -> bool:
        return self.rank == 0


def parse(raw: object) -> Ddp | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise DdpError("task.json: 'ddp' must be an object")
    rank, world, init = raw.get("rank"), raw.get("world_size"), raw.get("init_method")
    if not (isinstance(world, int) and not isinstance(world, bool) and 1 <= world <= 1024):
        raise DdpError(f"task.json: ddp.world_size must be 1..1024, got {world!r}")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < world):
        raise DdpError(f"task.json: ddp.rank must be 0..{world - 1}, got {rank!r}")
    if not (isinstance(init, str) and init.startswith("tcp://")):
        raise DdpError(f"task.json: ddp.init_method must be tcp://HOST:PORT, got {init!r}")
    return Ddp(rank, world, init)


def start(ddp: Ddp, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    # gloo on loopback: the interface must be the one the rendezvous address is on.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=ddp.init_method, rank=ddp.rank,
                            world_size=ddp.world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                            device_id=device if device.type == "cuda" else None)


def stop() -> None:
    if dist.is_initialized():
        # The round's wrapped model and its autograd graph hold the group; collected now, the
        # group's threads and their pending work are released while the interpreter is whole
        # (at its teardown that can abort the process: see lifetime.exit_now).
        gc.collect()
        dist.destroy_process_group()


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """The model for training: BatchNorm on the global batch, gradients averaged over ranks.
    The weights are read from `model` itself (the wrapper shares its parameters)."""
    sync_batchnorm(model, device)
    ids = [device.index] if device.type == "cuda" else None
    # Buffers are not broadcast at each forward: every rank starts from the same weights file
    # and the synced BatchNorm updates its running statistics identically on every rank.
    ddp_class = nn.parallel.DistributedDataParallel
    quiet = ("forward_sync_buffers" if "forward_sync_buffers" in
             inspect.signature(ddp_class.__init__).parameters else "broadcast_buffers")
    return ddp_class(model, device_ids=ids, **{quiet: False})


class _GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics are those of the whole global batch (summed over
    ranks with an autograd-aware all-reduce), on the CPU (gloo) as on CUDA; torch's
    SyncBatchNorm is CUDA-only. Same parameters and buffers as the layer it replaces."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        from torch.distributed.nn.functional import all_reduce

        dims = [0, *range(2, x.dim())]
        channels = x.shape[1]
        count = torch.tensor([x.numel() / channels], device=x.device, dtype=torch.float32)
        xf = x.float()
        stats = all_reduce(torch.cat([xf.sum(dims), (xf * xf).sum(dims), count]))
        n = stats[-1]
        mean = stats[:channels] / n
        var = (stats[channels:2 * channels] / n - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked += 1  # type: ignore[operator]
                m = self.momentum if self.momentum is not None else (
                    1.0 / float(self.num_batches_tracked))  # type: ignore[arg-type]
                unbiased = var * n / (n - 1).clamp_min(1)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.detach(), alpha=m)  # type: ignore[union-attr]
        shape = [1, channels] + [1] * (x.dim() - 2)
        out = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(x.dtype)


def sync_batchnorm(model: nn.Module, device: torch.device) -> None:
    """BatchNorm over the global batch: nothing to do for one worker; torch's SyncBatchNorm
    (fused kernels) on CUDA; `_GlobalBatchNorm` on the CPU. Children are replaced in place, so
    `model` keeps its parameters and state-dict names."""
    if dist.get_world_size() == 1:
        return
    if device.type == "cuda":
        for name, child in list(model.named_children()):
            setattr(model, name, nn.SyncBatchNorm.convert_sync_batchnorm(child))
        return
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
                module, nn.SyncBatchNorm):
            module.__class__ = type(f"Global{type(module).__name__}",
                                    (_GlobalBatchNorm, type(module)), {})


class ShardedBatches(Sampler[list[int]]):
    """Rank `rank`'s slice of each global batch the one-worker loader would draw: the same
    RandomSampler on the same generator, so the batches depend on the seed alone."""

    def __init__(self, global_batches: BatchSampler, ddp: Ddp) -> None:
        self.global_batches = global_batches
        self.ddp = ddp
        self.global_size = 0  # the size of the global batch the last slice came from

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches:
            self.global_size = len(batch)
            yield slice_of(batch, self.ddp)

    def __len__(self) -> int:
        return len(self.global_batches)


def slice_of(batch: Any, ddp: Ddp) -> Any:
    """Rank's contiguous share of a global batch (sizes differ by at most one)."""
    n = len(batch)
    lo = ddp.rank * n // ddp.world_size
    hi = (ddp.rank + 1) * n // ddp.world_size
    return batch[lo:hi]


def sharded_batches(ds: Any, batch_size: int, generator: torch.Generator, ddp: Ddp,
                    drop_last: bool) -> ShardedBatches:
    # Built as DataLoader(shuffle=True, generator=g) builds its own, so the generator is drawn
    # from in the same order as with one worker.
    sampler = RandomSampler(ds, generator=generator)
    return ShardedBatches(BatchSampler(sampler, batch_size, drop_last), ddp)


def loss_weight(local: int, global_size: int, ddp: Ddp) -> float:
    """DDP averages gradients over ranks; weighting each rank's mean loss by its share of the
    global batch (x world size) makes that average the global batch's mean-loss gradient."""
    return ddp.world_size * local / max(global_size, 1)


def all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


def any_rank(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather_seconds(seconds: float, device: torch.device) -> list[float]:
    """Every rank's training time, in rank order (each rank gets them all)."""
    world = dist.get_world_size()
    t = torch.zeros(world, dtype=torch.float64, device=device)
    t[dist.get_rank()] = seconds
    dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


def combine_metrics(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """The training metrics of the whole site from each rank's own (loss and accuracy weighted
    by the examples each saw; examples summed; steps are the same on every rank)."""
    seen = metrics.get("examples", 0.0)
    sums = all_sum([metrics.get("loss", 0.0) * seen, metrics.get("accuracy", 0.0) * seen,
                    seen], device)
    out = dict(metrics)
    total = max(sums[2], 1.0)
    out["loss"] = sums[0] / total
    if "accuracy" in metrics:
        out["accuracy"] = sums[1] / total
    out["examples"] = sums[2]
    return out


def train_tensor_task(task: Any, model: nn.Module, forward: nn.Module,
                      data: Mapping[str, torch.Tensor], device: torch.device,
                      hparams: Mapping[str, Any], seed: int, ddp: Ddp) -> tuple[int, dict]:
    """A tensor task (its data as whole tensors) trained data-parallel through its step
    methods (`optimizer`, `batch_size`, `train_size`, `batch_loss`), with the batch order of
    its own loop: a permutation per epoch from a generator seeded with the round's seed."""
    missing = [m for m in ("optimizer", "batch_size", "train_size", "batch_loss")
               if not callable(getattr(task, m, None))]
    if missing:
        raise DdpError(f"task {task.name!r} cannot train with workers > 1: it defines no "
                       f"{', '.join(missing)} (the steps the data-parallel loop drives)")
    own = task.hparams(hparams) if callable(getattr(task, "hparams", None)) else dict(hparams)
    epochs = int(own.get("local_epochs", 1))
    batch = int(task.batch_size(hparams))
    n = int(task.train_size(data))
    opt = task.optimizer(model, hparams)
    gen = torch.Generator(device=device).manual_seed(seed)
    loss_sum = correct = 0.0
    seen = steps = 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen, device=device)
        for start_at in range(0, n, batch):
            whole = order[start_at:start_at + batch]
            idx = slice_of(whole, ddp)
            loss, right = task.batch_loss(forward, data, idx)
            opt.zero_grad(set_to_none=True)
            (loss * loss_weight(len(idx), len(whole), ddp)).backward()
            opt.step()
            loss_sum += float(loss.detach()) * len(idx)
            correct += float(right) if right is not None else 0.0
            seen += len(idx)
            steps += 1
    metrics = {"loss": loss_sum / max(seen, 1), "accuracy": correct / max(seen, 1),
               "steps": float(steps), "examples": float(seen)}
    return n, metrics
