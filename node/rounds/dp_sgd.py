"""Example-level differential privacy on the node: DP-SGD through Opacus, as runner options.

A job turns it on with hyperparameters the runner takes out before the task sees the rest:

    dp_sgd = true             # per-example clipping + Gaussian noise on every step
    max_grad_norm = 1.0       # the clip of each example's gradient (L2)
    noise_multiplier = 1.1    # std of the noise / max_grad_norm; or give dp_target_epsilon
    dp_target_epsilon = 8.0   # the noise is derived so that dp_rounds rounds spend this
    dp_rounds = 10            # the rounds the target covers (a job file: its rounds)
    dp_delta = 1e-5
    dp_accountant = "rdp"     # Opacus's: "rdp" | "prv" | "gdp"
    dp_fix_model = false      # let Opacus replace layers it refuses (BatchNorm -> GroupNorm)

Opacus computes the per-sample gradients, clips and noises them (DPOptimizer), samples each
batch by Poisson sampling (DPDataLoader) and keeps the node's own accountant; nothing of that is
written here. The batches' sampling and the noise draw from generators seeded by the operating
system, not by the job's seed: whoever knows a seed can replay the noise.

The spent epsilon goes into the round's train metrics: `dp_epsilon` for this round's steps, and
`dp_epsilon_total`, the bound for this node having trained in every round up to this one with
the same settings (rounds compose; a node that skipped some spent less).
"""

from __future__ import annotations

import logging
import secrets
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import DataLoader

from fedgpu.node.rounds.switches import Amp, Switches
from fedgpu.node.tasks.base import HyperparameterError, Metrics, resolve_hparams

log = logging.getLogger("fedgpu.worker")

DP_DEFAULTS: dict[str, int | float | bool | str] = {
    "dp_sgd": False,
    "max_grad_norm": 1.0,
    "noise_multiplier": 0.0,  # 0: derived from dp_target_epsilon
    "dp_target_epsilon": 0.0,  # 0: no target; noise_multiplier is given
    "dp_rounds": 1,
    "dp_delta": 1e-5,
    "dp_accountant": "rdp",
    "dp_fix_model": False,
}
DP_ACCOUNTANTS = ("rdp", "prv", "gdp")


class DpModelError(HyperparameterError):
    """The task's model has layers Opacus cannot compute per-sample gradients for."""


@dataclass(frozen=True)
class DpSgd:
    max_grad_norm: float
    noise_multiplier: float  # 0 when derived from target_epsilon
    target_epsilon: float  # 0: none
    rounds: int
    delta: float
    accountant: str
    fix_model: bool


def split_dp(task_name: str, given: Mapping[str, Any]) -> tuple[DpSgd | None, dict[str, Any]]:
    """(DP-SGD settings when dp_sgd = true else None, the hyperparameters without ours)."""
    picked = {k: v for k, v in given.items() if k in DP_DEFAULTS}
    rest = {k: v for k, v in given.items() if k not in DP_DEFAULTS}
    hp = resolve_hparams(task_name, picked, DP_DEFAULTS)
    if not hp["dp_sgd"]:
        stray = sorted(set(picked) - {"dp_sgd"})
        if stray:
            raise HyperparameterError(f"task {task_name!r}: hyperparameter(s) {', '.join(stray)} "
                                      "only apply with dp_sgd = true")
        return None, rest

    def refuse(key: str, expected: str) -> None:
        raise HyperparameterError(
            f"task {task_name!r}: hyperparameter {key} must be {expected}, got {hp[key]!r}")

    if not hp["max_grad_norm"] > 0:
        refuse("max_grad_norm", "> 0")
    if hp["noise_multiplier"] < 0:
        refuse("noise_multiplier", ">= 0")
    if hp["dp_target_epsilon"] < 0:
        refuse("dp_target_epsilon", "> 0 (or 0: none)")
    if hp["dp_rounds"] < 1:
        refuse("dp_rounds", ">= 1")
    if not 0 < hp["dp_delta"] < 1:
        refuse("dp_delta", "in (0, 1)")
    if hp["dp_accountant"] not in DP_ACCOUNTANTS:
        refuse("dp_accountant", f"one of {', '.join(DP_ACCOUNTANTS)}")
    if (hp["noise_multiplier"] > 0) == (hp["dp_target_epsilon"] > 0):
        raise HyperparameterError(
            f"task {task_name!r}: dp_sgd = true needs one of noise_multiplier (> 0) or "
            "dp_target_epsilon (the noise is then derived from it), not both")
    return DpSgd(hp["max_grad_norm"], hp["noise_multiplier"], hp["dp_target_epsilon"],
                 hp["dp_rounds"], hp["dp_delta"], hp["dp_accountant"], hp["dp_fix_model"]), rest


def prepare_model(task_name: str, model: torch.nn.Module, dp: DpSgd) -> torch.nn.Module:
    """The model as Opacus will train it: fixed when asked, refused with Opacus's reasons else.

    Called in every round kind, the initial model's included, so a fixed model has the same
    tensors on every node and the job fails at its start when Opacus refuses the model.
    """
    from opacus.validators import ModuleValidator

    if dp.fix_model:
        fixed = ModuleValidator.fix(model)
        if fixed is not model:
            log.info("dp_fix_model: Opacus replaced the layers it refuses in task %r's model "
                     "(BatchNorm -> GroupNorm)", task_name)
        model = fixed
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        reasons = "; ".join(" ".join(str(e).split()) for e in errors[:3])
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise DpModelError(
            f"task {task_name!r}: Opacus cannot train this model with DP-SGD: {reasons}{more}. "
            "Set dp_fix_model = true to let Opacus replace those layers (BatchNorm becomes "
            "GroupNorm, on every node and in the initial model), or use a model without them")
    return model


def dp_switches(task_name: str, switches: Switches) -> Switches:
    """The switches DP-SGD trains under: compile and amp are turned off, with a log line.
    Opacus's per-sample gradient hooks do not follow torch.compile's graphs, nor float16's
    scaled gradients."""
    if switches.compile or switches.amp is not Amp.OFF:
        log.info("task %r: compile and amp are off under dp_sgd (Opacus's per-sample gradients "
                 "need the plain float32 module)", task_name)
    return replace(switches, compile=False, amp=Amp.OFF)


def _os_generator(device: torch.device | None = None) -> torch.Generator:
    gen = torch.Generator(device=device) if device is not None else torch.Generator()
    return gen.manual_seed(secrets.randbits(63))


class PrivateTraining:
    """One round's DP-SGD: wraps the model, optimizer and loader, then reports the spend."""

    def __init__(self, task_name: str, dp: DpSgd, round_number: int) -> None:
        self.task_name = task_name
        self.dp = dp
        self.round_number = max(1, round_number)
        self.engine: Any = None
        self.module: Any = None
        self.noise_multiplier = dp.noise_multiplier
        self.sample_rate = 0.0
        self.planned_steps = 0

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             loader: DataLoader[Any], epochs: int, max_steps: int = 0
             ) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
        from opacus import PrivacyEngine
        from opacus.accountants.utils import get_noise_multiplier

        steps_per_epoch = len(loader)
        if steps_per_epoch < 1:
            raise HyperparameterError(f"task {self.task_name!r}: DP-SGD needs a non-empty "
                                      "training set")
        self.sample_rate = 1 / steps_per_epoch
        steps = epochs * steps_per_epoch
        if max_steps:
            steps = min(steps, max_steps)
        self.planned_steps = steps
        if self.dp.target_epsilon > 0:
            # Every round of the budget is assumed to take this round's full step count: a
            # round cut short by max_train_seconds spends less than planned, never more.
            self.noise_multiplier = float(get_noise_multiplier(
                target_epsilon=self.dp.target_epsilon, target_delta=self.dp.delta,
                sample_rate=self.sample_rate, steps=steps * self.dp.rounds,
                accountant=self.dp.accountant))
            log.info("DP-SGD: noise_multiplier %.4f for epsilon %g over %d round(s) of %d steps "
                     "at sampling rate %.4g", self.noise_multiplier, self.dp.target_epsilon,
                     self.dp.rounds, steps, self.sample_rate)
        # The sampling is Poisson's from a generator the job's seed does not predict.
        loader.generator = _os_generator()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        with warnings.catch_warnings():
            # "Secure RNG turned off": Opacus's secure_mode needs torchcsprng; the generators
            # here are torch's, seeded by the OS (the docs page says what that leaves open).
            warnings.filterwarnings("ignore", message="Secure RNG turned off")
            self.engine = PrivacyEngine(accountant=self.dp.accountant)
        # Opacus refuses a module in eval mode (the round evaluated the global model first).
        model.train()
        module, opt, dp_loader = self.engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader,
            noise_multiplier=self.noise_multiplier, max_grad_norm=self.dp.max_grad_norm,
            poisson_sampling=True, noise_generator=_os_generator(device))
        self.module = module
        return module, opt, dp_loader

    def finish(self) -> Metrics:
        """Removes Opacus's hooks from the model and returns the round's privacy metrics."""
        if self.engine is None:
            return {}
        if self.module is not None:
            self.module.cleanup()
            self.module = None
        accountant = self.engine.accountant
        spent = float(accountant.get_epsilon(self.dp.delta)) if accountant.history else 0.0
        steps = sum(int(n) for _, _, n in accountant.history)
        # Every earlier round at its full planned steps, then this one as it ran: an upper
        # bound for this node (a round cut short by max_train_seconds took fewer steps).
        total = type(accountant)()
        earlier = (self.noise_multiplier, self.sample_rate, self.planned_steps)
        total.history = [earlier] * (self.round_number - 1) + list(accountant.history)
        spent_total = float(total.get_epsilon(self.dp.delta)) if total.history else 0.0
        return {
            "dp_epsilon": round(spent, 6),
            "dp_epsilon_total": round(spent_total, 6),
            "dp_delta": self.dp.delta,
            "dp_noise_multiplier": round(self.noise_multiplier, 6),
            "dp_sample_rate": round(self.sample_rate, 6),
            "dp_steps": float(steps),
        }


def train_tensor_task(task: Any, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                      device: torch.device, hparams: Mapping[str, Any],
                      private: PrivateTraining) -> tuple[int, Metrics]:
    """DP-SGD for a tensor task (node/tasks/base.py Task) with the step-wise methods of
    RingTask (optimizer, batch_size, train_size, batch_loss): the runner drives its loop here,
    since a task's own loop cannot sample batches the Poisson way."""
    needed = ("optimizer", "batch_size", "train_size", "batch_loss")
    missing = [m for m in needed if not callable(getattr(task, m, None))]
    if missing:
        raise HyperparameterError(
            f"task {task.name!r} runs its own training loop and lacks {', '.join(missing)}, "
            "which dp_sgd needs to drive the loop (see node/tasks/base.py RingTask)")
    n = int(task.train_size(data))
    epochs = int(hparams.get("local_epochs", 1))
    # The loader yields row numbers; the task indexes its tensors already on the device.
    rows = torch.utils.data.TensorDataset(torch.arange(n))
    loader: DataLoader[Any] = DataLoader(rows, batch_size=int(task.batch_size(hparams)))
    module, opt, dp_loader = private.wrap(model, task.optimizer(model, hparams), loader, epochs)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.int64)
    seen = 0
    for _ in range(epochs):
        for (idx,) in dp_loader:
            idx = idx.to(device)
            opt.zero_grad(set_to_none=True)
            loss, right = task.batch_loss(module, data, idx)
            # An empty Poisson batch still takes its (noise-only) step: the accountant counts it.
            loss.backward()
            opt.step()
            if len(idx):
                loss_sum += loss.detach() * len(idx)
                correct += right
                seen += len(idx)
    metrics = {"loss": float(loss_sum) / max(seen, 1), "accuracy": float(correct) / max(seen, 1)}
    metrics.update(private.finish())
    return n, metrics
