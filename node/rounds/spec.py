"""A round's task.json as the runner takes it: parsed and checked into a RoundSpec, every
problem one line of BadInputError (exit status 2: retrying will not help)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedgpu.node.rounds import ddp, local_dp
from fedgpu.node.rounds.workfiles import KINDS, Kind
from fedgpu.node.tasks.bundled import BundleSpec


class BadInputError(ValueError):
    """task.json or the weights sent with it cannot be used; retrying will not help."""



@dataclass(frozen=True)
class RoundSpec:
    kind: Kind
    task_name: str
    hyperparameters: dict[str, Any]
    seed: int
    round: int
    data_dir: Path | None
    device: str
    memory_fraction: float | None = None
    torch_threads: int | None = None
    # The task came as a bundle (node/tasks/bundled.py); None: an installed task.
    bundle: BundleSpec | None = None
    privacy: local_dp.LocalDp | None = None  # [privacy] mode = "local" (node/rounds/local_dp.py)
    # Where the site keeps its local tensors (local_params; node/rounds/local_state.py).
    local_state_dir: str | None = None
    # One of several data-parallel workers of the round (node/rounds/ddp.py); None: the only one.
    ddp: ddp.Ddp | None = None



def parse_spec(raw: object) -> RoundSpec:
    """Validate task.json's content; every problem is a one-line BadInputError."""
    if not isinstance(raw, Mapping):
        raise BadInputError("task.json must hold a JSON object")

    def need(key: str, kind: type | tuple[type, ...], what: str, optional: bool = False) -> Any:
        if key not in raw:
            if optional:
                return None
            raise BadInputError(f"task.json: '{key}' is missing")
        value = raw[key]
        if value is None and optional:
            return None
        # bool is an int in Python; "seed": true is a mistake.
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise BadInputError(f"task.json: '{key}' must be {what}, got {value!r}")
        if not isinstance(value, kind):
            raise BadInputError(f"task.json: '{key}' must be {what}, got {value!r}")
        return value

    kind = need("kind", str, "a string")
    if kind not in KINDS:
        raise BadInputError(f"task.json: 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    data_dir = need("data_dir", str, "a path", optional=kind == "init")
    device = need("device", str, "'cpu' or 'cuda:N'")
    try:
        device_type = torch.device(device).type
    except RuntimeError:
        device_type = None
    if device_type not in ("cpu", "cuda"):
        raise BadInputError(f"task.json: 'device' must be 'cpu' or 'cuda:N', got {device!r}")
    fraction = need("memory_fraction", (int, float), "a number in (0, 1]", optional=True)
    if fraction is not None and not 0 < fraction <= 1:
        raise BadInputError(f"task.json: 'memory_fraction' must be in (0, 1], got {fraction}")
    threads = need("torch_threads", int, "a positive integer", optional=True)
    if threads is not None and threads < 1:
        raise BadInputError(f"task.json: 'torch_threads' must be >= 1, got {threads}")
    return RoundSpec(
        kind=kind,
        task_name=need("task_name", str, "a string"),
        hyperparameters=dict(need("hyperparameters", dict, "an object")),
        seed=need("seed", int, "an integer"),
        round=need("round", int, "an integer"),
        data_dir=Path(data_dir) if data_dir else None,
        device=device,
        memory_fraction=float(fraction) if fraction is not None else None,
        torch_threads=threads,
        bundle=BundleSpec.parse(raw["bundle"]) if raw.get("bundle") is not None else None,
        privacy=local_dp.parse(raw.get(local_dp.SECTION)),
        local_state_dir=need("local_state_dir", str, "a path", optional=True),
        ddp=_ddp(raw.get(ddp.SECTION)),
    )


def _ddp(raw: object) -> ddp.Ddp | None:
    try:
        return ddp.parse(raw)
    except ddp.DdpError as exc:
        raise BadInputError(str(exc)) from None
