"""The files `fedgpu task new NAME` writes: a working task bundle to start from.

A tensor task (node/tasks/base.py `Task`) on the data directory `fedgpu data split` writes
(train.safetensors / test.safetensors with `x` float32 [N, C, H, W] and `y` int64 [N]), with
comments on what to change. `fedgpu task check` runs it as a node would.
"""

from __future__ import annotations

import re

MANIFEST = '''\
# A fedgpu task bundle (docs: tutorials/own-task.md). `fedgpu job submit --task-dir` packs this
# directory deterministically and names it by its sha256; each site approves that hash
# ('fedgpu node approve SHA256'). Change one byte of any file here and it is a new bundle,
# to be approved again. Hidden files, __pycache__/ and *.pyc are left out of the bundle.

# The task name jobs use: `task = "{name}"` in a job file (or leave `task` out and give
# `task_dir`). Letters, digits, '.', '_' and '-'.
name = "{name}"

# module:Class of the task, inside this directory. The top-level package ({package}) must not
# have the name of a module installed on the nodes.
entry = "{package}.task:{cls}"

# Distributions the nodes must already have, checked before the task is imported (nothing is
# installed at run time), e.g. requires = ["scipy>=1.11"]. torch and fedgpu are always there.
requires = []
'''

INIT = '''\
"""The {name} task (a fedgpu task bundle)."""
'''

TASK = '''\
"""The {name} task: a small CNN trained with SGD on the node's data directory.

A node calls, in its round's worker process (the runner owns the device: it builds the model
under torch.device(...) and moves the data there; never call .to() or .cuda() here):

    build_model(hparams)                       a fresh model (the first round's comes from one node)
    load_data(data_dir)                        this node's tensors, on the CPU
    train(model, data, device, hparams, seed)  -> (examples, {{"loss": ..., "accuracy": ...}})
    evaluate(model, data, device, hparams)     -> (examples, {{"loss": ..., "accuracy": ...}})

What to change for your own model: the layers in build_model (keep them deterministic given the
seed the runner sets), DEFAULTS (each key is a hyperparameter a job may set under
[hyperparameters]; unknown keys are refused), load_data if your sites hold other files, and the
loss in train/evaluate. For data that does not fit in memory, implement the Dataset contract
instead (load_datasets, optimizer, batch_loss: see fedgpu/node/tasks/base.py and docs:
reference/tasks.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedgpu.node.data import read_split
from fedgpu.node.tasks.base import resolve_hparams

# Hyperparameters and their defaults; a job overrides them in [hyperparameters].
DEFAULTS: dict[str, int | float] = {{
    "lr": 0.05,
    "momentum": 0.9,
    "local_epochs": 1,
    "batch_size": 32,
    "in_channels": 1,     # 1 for `fedgpu data split` digits (8x8 grey images)
    "num_classes": 10,
}}


class {cls}:
    name = "{name}"

    def build_model(self, hparams: Mapping[str, Any]) -> nn.Module:
        hp = resolve_hparams(self.name, hparams, DEFAULTS)
        # Adaptive pooling makes the head independent of the images' height and width.
        return nn.Sequential(OrderedDict(
            conv1=nn.Conv2d(hp["in_channels"], 16, 3, padding=1),
            relu1=nn.ReLU(),
            conv2=nn.Conv2d(16, 32, 3, padding=1),
            relu2=nn.ReLU(),
            pool=nn.AdaptiveAvgPool2d(4),
            flatten=nn.Flatten(),
            fc1=nn.Linear(32 * 4 * 4, 64),
            relu3=nn.ReLU(),
            fc2=nn.Linear(64, hp["num_classes"]),
        ))

    def load_data(self, data_dir: Path) -> Mapping[str, torch.Tensor]:
        # The files `fedgpu data split` writes; change this if your sites hold other data.
        train = read_split(data_dir, "train.safetensors")
        test = read_split(data_dir, "test.safetensors")
        return {{
            "x_train": torch.from_numpy(train["x"]).float(),
            "y_train": torch.from_numpy(train["y"]).long(),
            "x_test": torch.from_numpy(test["x"]).float(),
            "y_test": torch.from_numpy(test["y"]).long(),
        }}

    def train(self, model: nn.Module, data: Mapping[str, torch.Tensor], device: torch.device,
              hparams: Mapping[str, Any], seed: int) -> tuple[int, dict[str, float]]:
        hp = resolve_hparams(self.name, hparams, DEFAULTS)
        x, y = data["x_train"], data["y_train"]
        opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp["momentum"])
        gen = torch.Generator(device=device).manual_seed(seed)
        # Summed on the device: a float() per step would wait for the GPU every batch.
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.int64)
        seen = 0
        model.train()
        for _ in range(hp["local_epochs"]):
            order = torch.randperm(len(y), generator=gen, device=device)
            for start in range(0, len(y), hp["batch_size"]):
                idx = order[start:start + hp["batch_size"]]
                logits = model(x[idx])
                loss = F.cross_entropy(logits, y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_sum += loss.detach() * len(idx)
                correct += (logits.argmax(1) == y[idx]).sum()
                seen += len(idx)
        # FedAvg weighs this update by the size of the local training set.
        return len(y), {{"loss": float(loss_sum) / max(seen, 1),
                         "accuracy": float(correct) / max(seen, 1)}}

    def evaluate(self, model: nn.Module, data: Mapping[str, torch.Tensor],
                 device: torch.device, hparams: Mapping[str, Any]) -> tuple[int, dict[str, float]]:
        x, y = data["x_test"], data["y_test"]
        model.eval()
        with torch.no_grad():
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            correct = int((logits.argmax(1) == y).sum())
        return len(y), {{"loss": float(loss), "accuracy": correct / max(len(y), 1)}}
'''

# What `fedgpu task new` prints: a job for the new task. Not written into the directory: every
# file there is part of the bundle, and a job's settings must not change the code's hash.
JOB = '''\
task = "{name}"
task_dir = "{path}"     # relative to the job file
rounds = 3
min_nodes = 2
round_deadline_s = 300

[hyperparameters]
lr = 0.05
'''


def package_name(name: str) -> str:
    """The Python package a task named `name` lives in (an identifier, suffixed so it is
    unlikely to shadow an installed module)."""
    base = re.sub(r"[^0-9a-zA-Z_]", "_", name).lower().strip("_") or "my"
    if base[0].isdigit():
        base = f"t_{base}"
    return f"{base}_task"


def class_name(name: str) -> str:
    parts = [p for p in re.split(r"[^0-9a-zA-Z]", name) if p]
    text = "".join(p[:1].upper() + p[1:] for p in parts) or "My"
    return ("T" + text if text[0].isdigit() else text) + "Task"


def files(name: str) -> dict[str, str]:
    """Relative path -> text of a new task directory."""
    package, cls = package_name(name), class_name(name)
    fields = {"name": name, "package": package, "cls": cls}
    return {
        "fedgpu-task.toml": MANIFEST.format(**fields),
        f"{package}/__init__.py": INIT.format(**fields),
        f"{package}/task.py": TASK.format(**fields),
    }
