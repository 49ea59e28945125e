"""The file contract between the node agent and the per-round training subprocess.

The agent writes `task.json` (and `weights.in.safetensors`) into a fresh work directory, runs
`python -m fedgpu.node.rounds.worker WORKDIR`, and reads back `result.json` +
`weights.out.safetensors`, or
`error.json` when the exit status is non-zero. Torch-free, so the agent can import it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

from fedgpu.core.constants import TASK_KINDS

TASK_FILE = "task.json"
WEIGHTS_IN = "weights.in.safetensors"
WEIGHTS_OUT = "weights.out.safetensors"
RESULT_FILE = "result.json"
ERROR_FILE = "error.json"

# Variables the agent decides only when the round starts (which GPU, the memory cap); a
# pre-started worker receives them with the round and sets them before CUDA is initialised,
# which torch does lazily on first use, so they take effect as if given at process start.
ROUND_ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "FEDGPU_DEVICE", "FEDGPU_MEMORY_FRACTION")

Kind = Literal["init", "train", "evaluate", "statistics"]
KINDS: tuple[Kind, ...] = TASK_KINDS  # type: ignore[assignment]
ErrorKind = Literal["oom", "exception", "bad_input"]
EXIT_OK = 0
EXIT_EXCEPTION = 1
EXIT_BAD_INPUT = 2
EXIT_OOM = 3
EXIT_CODES: dict[ErrorKind, int] = {
    "exception": EXIT_EXCEPTION,
    "bad_input": EXIT_BAD_INPUT,
    "oom": EXIT_OOM,
}


class TaskFile(TypedDict):
    kind: Kind
    task_name: str
    hyperparameters: dict[str, Any]
    seed: int
    round: int
    data_dir: str
    device: str
    memory_fraction: float | None
    torch_threads: int | None


class ResultFile(TypedDict):
    num_examples: int
    train_metrics: dict[str, float]
    eval_metrics: dict[str, float]
    num_eval_examples: int
    torch_peak_allocated_mib: int
    torch_peak_reserved_mib: int
    rss_peak_mib: int
    train_seconds: float
    device_name: str
    # A statistics round: the columns' exact summaries (node/rounds/site_statistics.py).
    statistics: NotRequired[list[dict[str, Any]] | None]


class ErrorFile(TypedDict):
    error: str
    kind: ErrorKind
    # Ring blocks: the ranks the worker found gone (absent when it failed on its own).
    lost_ranks: NotRequired[list[int]]


def lost_ranks(workdir: Path | None) -> list[int]:
    """The ranks a failed ring worker named in its error.json; [] for anything else."""
    try:
        doc = json.loads((Path(workdir) / ERROR_FILE).read_text()) if workdir else {}
    except (OSError, ValueError):
        return []
    ranks = doc.get("lost_ranks") if isinstance(doc, dict) else None
    return [r for r in ranks if type(r) is int] if isinstance(ranks, list) else []


def write_json(path: Path, obj: object) -> None:
    # Written aside and renamed: a reader never sees half a file, even if the process dies.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
