"""The node's data directory: checked at agent start-up, read by the training subprocess.

No torch here: the agent imports this module and must stay torch-free; tasks turn the numpy
arrays into tensors themselves.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core import codec
from fedgpu.core.datasets import DATA_FILES, NODE_DIR_PREFIX, TRAIN_FILE
from fedgpu.core.errors import FedgpuError
from fedgpu.core.imagefolders import SPLIT_DIRS

# A language-model site's text: one of these (or train/ and test/ folders of them).
TEXT_TRAIN_FILES = ("train.jsonl", "train.txt")
_HOW_TO_MAKE = "make per-node partitions with 'fedgpu data split --out DIR --nodes N'"


class DataDirError(FedgpuError, ValueError):
    """The node's data directory is missing or does not hold what the task reads."""

    exit_code = 2


def check_data_dir(path: Path, required: Sequence[str] = DATA_FILES) -> None:
    """Fail fast, before the first round, with what is missing and how to make it.

    A node serves whatever jobs come, so either layout passes: the tensor files of `required`
    (digits) or an image folder's train/ and test/ (images; its files are checked per round).
    """
    path = Path(path)
    if not path.exists():
        raise DataDirError(
            f"data directory {path} does not exist: {_HOW_TO_MAKE} and point the node at one "
            f"of the node-K directories it writes"
        )
    if not path.is_dir():
        raise DataDirError(f"data directory {path} is not a directory: {_HOW_TO_MAKE}")
    missing = [name for name in required if not (path / name).is_file()]
    if missing and all((path / d).is_dir() for d in SPLIT_DIRS):
        return
    if missing and any((path / n).is_file() for n in TEXT_TRAIN_FILES):
        return  # causal-lm's text (node/tasks/causal_lm/corpus.py checks it per round)
    if not missing:
        for name in required:
            if name.endswith(".safetensors"):
                _check_header(path / name)
        return
    partitions = sorted(p.name for p in path.glob(f"{NODE_DIR_PREFIX}*") if p.is_dir())
    if partitions:
        # A common slip: mounting the whole split instead of one node's share of it.
        raise DataDirError(
            f"data directory {path} holds the partitions {', '.join(partitions)}, not one "
            f"node's data: point the node at one of them, e.g. {path / partitions[0]}"
        )
    raise DataDirError(
        f"data directory {path} has no {', '.join(missing)}: {_HOW_TO_MAKE} "
        f"(e.g. 'fedgpu data split --out ./data --nodes 3') and use ./data/node-1; an image "
        f"task needs {'/ and '.join(SPLIT_DIRS)}/ folders instead ('fedgpu data synth-images' "
        f"or 'split-folder'); a language-model task reads train.jsonl or train.txt "
        f"('fedgpu data synth-lm')"
    )


def read_split(data_dir: Path, filename: str) -> dict[str, np.ndarray]:
    """All tensors of one split file as writable numpy arrays (torch wants writable memory)."""
    path = Path(data_dir) / filename
    try:
        return codec.read_file(path)
    except OSError as exc:
        raise DataDirError(f"cannot read {path}: {exc.strerror or exc}; {_HOW_TO_MAKE}") from None
    except codec.CodecError as exc:
        raise _invalid(path, exc) from None


def train_examples(data_dir: Path) -> int:
    """How many training examples the data directory holds (the leading dimension of `y` in
    train.safetensors); 0 when that cannot be told. Stated at registration: the aggregator
    refuses an update that claims to weigh more than this."""
    try:
        header = _check_header(Path(data_dir) / TRAIN_FILE)
    except DataDirError:
        return 0
    info = header.get("y") or next((v for k, v in header.items() if k != "__metadata__"), None)
    shape = info.get("shape") if isinstance(info, dict) else None
    if isinstance(shape, list) and shape and type(shape[0]) is int and shape[0] >= 0:
        return int(shape[0])
    return 0


def _check_header(path: Path) -> dict[str, Any]:
    # Only the header: a site's real data set may be large, and start-up should stay quick.
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise ValueError("file is shorter than a safetensors header")
            (head_len,) = struct.unpack("<Q", raw_len)
            if head_len > codec.MAX_HEADER_BYTES:
                raise ValueError(f"header length {head_len} is implausible")
            header = json.loads(f.read(head_len))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            return header
    except (OSError, ValueError) as exc:
        raise _invalid(path, exc) from None


def _invalid(path: Path, exc: Exception) -> DataDirError:
    return DataDirError(f"{path} is not a valid safetensors file ({exc}); {_HOW_TO_MAKE}")
