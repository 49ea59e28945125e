"""Per-node partitions of a dataset that ships inside a Python package (no download at run time).

A split directory holds `node-1 .. node-N`; each is what one node mounts as its data directory:
`train.safetensors` and `test.safetensors` (keys `x`, `y`, written with `fedgpu.core.codec`) and a
`meta.json` describing the partition. Each node's held-out split is cut from its own partition,
so federated evaluation measures the global model on data shaped like that node's.

This module lives in the core package (no torch); scikit-learn, which carries the digits data,
is imported only when a split is made because the aggregator image does not install it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedgpu.core import codec
from fedgpu.core.constants import PARTITIONS

TRAIN_FILE = "train.safetensors"
TEST_FILE = "test.safetensors"
META_FILE = "meta.json"
DATA_FILES = (TRAIN_FILE, TEST_FILE)
NODE_DIR_PREFIX = "node-"
NUM_DIGIT_CLASSES = 10
# Enough that a node still has a few training examples and at least one held-out example
# after the test split is cut; a node with nothing to train on would stall a round.
MIN_EXAMPLES_PER_NODE = 10
# Redraws of the Dirichlet proportions before topping up starved nodes by hand: small alphas
# with many nodes rarely give every node enough examples by chance.
_DIRICHLET_REDRAWS = 100

Partition = Literal["iid", "dirichlet"]  # the values of constants.Partition, for type checkers


class MissingDependencyError(ImportError):
    """An optional package this operation needs is not installed."""


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's bundled 8x8 digits as `x` float32 [n,1,8,8] in [0,1] and `y` int64 [n]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise MissingDependencyError(
            "the digits dataset needs scikit-learn, which only the node extra installs: "
            "pip install 'fedgpu[node]'"
        ) from exc
    bunch = load_digits()
    # Pixel intensities in the bundled set are 0..16.
    x = (np.asarray(bunch.data, dtype=np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = np.asarray(bunch.target, dtype=np.int64)
    return np.ascontiguousarray(x), y


def partition_indices(
    labels: np.ndarray,
    nodes: int,
    partition: Partition,
    alpha: float,
    rng: np.random.Generator,
    min_per_node: int = MIN_EXAMPLES_PER_NODE,
) -> list[np.ndarray]:
    """Disjoint index sets, one per node, that together cover every example exactly once."""
    n = len(labels)
    if nodes * min_per_node > n:
        raise ValueError(
            f"{n} examples cannot give {nodes} nodes at least {min_per_node} each; "
            f"use at most {n // min_per_node} nodes"
        )
    if partition == "iid":
        return [np.sort(part) for part in np.array_split(rng.permutation(n), nodes)]
    parts: list[np.ndarray] = []
    for _ in range(_DIRICHLET_REDRAWS):
        parts = _dirichlet_draw(labels, nodes, alpha, rng)
        if min(len(p) for p in parts) >= min_per_node:
            break
    else:
        parts = _top_up(parts, min_per_node, rng)
    return [np.sort(p) for p in parts]


def _dirichlet_draw(
    labels: np.ndarray, nodes: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    # Per class, a Dirichlet(alpha) draw says which share of that class each node gets: small
    # alpha concentrates a class on few nodes (label skew), large alpha approaches IID.
    buckets: list[list[np.ndarray]] = [[] for _ in range(nodes)]
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        shares = rng.dirichlet(np.full(nodes, alpha))
        cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(np.int64)
        for node, chunk in enumerate(np.split(idx, cuts)):
            buckets[node].append(chunk)
    return [np.concatenate(b) if b else np.empty(0, np.int64) for b in buckets]


def _top_up(
    parts: list[np.ndarray], min_per_node: int, rng: np.random.Generator
) -> list[np.ndarray]:
    # Move random examples from the largest partition to each starved one; this softens the
    # skew only as much as needed to give every node something to train and test on.
    parts = [rng.permutation(p) for p in parts]
    for i in range(len(parts)):
        while len(parts[i]) < min_per_node:
            donor = max(range(len(parts)), key=lambda j: len(parts[j]))
            take = min(min_per_node - len(parts[i]), len(parts[donor]) - min_per_node)
            parts[i] = np.concatenate([parts[i], parts[donor][:take]])
            parts[donor] = parts[donor][take:]
    return parts


def split_digits(
    out: Path,
    nodes: int,
    partition: Partition = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    test_fraction: float = 0.2,
    force: bool = False,
) -> list[Path]:
    """Write `out/node-1 .. out/node-N` and return those directories in order."""
    out = Path(out)
    validate_split_args(out, nodes, partition, alpha, test_fraction, force)
    x, y = load_digits_arrays()
    rng = np.random.default_rng(seed)
    parts = partition_indices(y, nodes, partition, alpha, rng)
    if force and out.exists():
        remove_old_splits(out)
    out.mkdir(parents=True, exist_ok=True)
    dirs: list[Path] = []
    for number, idx in enumerate(parts, start=1):
        train_idx, test_idx = holdout_cut(idx, test_fraction, rng)
        node_dir = out / f"{NODE_DIR_PREFIX}{number}"
        node_dir.mkdir()
        _write_split(node_dir / TRAIN_FILE, x[train_idx], y[train_idx], "train")
        _write_split(node_dir / TEST_FILE, x[test_idx], y[test_idx], "test")
        meta = {
            "dataset": "digits",
            "node": number,
            "nodes": nodes,
            "partition": partition,
            "alpha": alpha if partition == "dirichlet" else None,
            "seed": seed,
            "test_fraction": test_fraction,
            "num_train": int(len(train_idx)),
            "num_test": int(len(test_idx)),
            "class_histogram": {
                "train": class_histogram(y[train_idx]),
                "test": class_histogram(y[test_idx]),
            },
        }
        (node_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        dirs.append(node_dir)
    return dirs


def holdout_cut(
    idx: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices of one node's part; each keeps at least one example."""
    # Shuffled again so the held-out cut is not biased by the class order within a part.
    idx = rng.permutation(idx)
    n_test = min(max(1, round(len(idx) * test_fraction)), len(idx) - 1)
    return np.sort(idx[n_test:]), np.sort(idx[:n_test])


def class_histogram(labels: np.ndarray, num_classes: int = NUM_DIGIT_CLASSES) -> list[int]:
    return [int(c) for c in np.bincount(labels, minlength=num_classes)]


def read_meta(node_dir: Path) -> Mapping[str, Any]:
    return json.loads((Path(node_dir) / META_FILE).read_text())


def validate_split_args(
    out: Path, nodes: int, partition: str, alpha: float, test_fraction: float, force: bool
) -> None:
    if nodes < 1:
        raise ValueError(f"--nodes must be at least 1, got {nodes}")
    if partition not in PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; choose one of {', '.join(PARTITIONS)}")
    if not alpha > 0:
        raise ValueError(f"--alpha must be > 0, got {alpha}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be between 0 and 1, got {test_fraction}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} exists and is not empty; pass --force to replace its splits")


def remove_old_splits(out: Path) -> None:
    # Only our own node-K directories go: a stale node-5 from an earlier 5-node split would
    # otherwise sit beside a fresh 3-node one. Anything else in the directory is the user's.
    for child in out.iterdir():
        if child.is_dir() and child.name.startswith(NODE_DIR_PREFIX):
            shutil.rmtree(child)


def _write_split(path: Path, x: np.ndarray, y: np.ndarray, split: str) -> None:
    encoded = codec.encode({"x": x, "y": y}, {"dataset": "digits", "split": split})
    with open(path, "wb") as f:
        for segment in encoded.segments:
            f.write(segment)
