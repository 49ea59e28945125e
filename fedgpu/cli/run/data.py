"""What `fedgpu run` trains on: per-task default hyperparameters and each node's data directory.

digits is split from the packaged data set, images is synthesised (fedgpu/core/synth_images.py);
any other task, or a real data set, comes as an existing split (`--data DIR` holding node-1 ..
node-N, as `fedgpu data split|synth-images|split-folder` write them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedgpu.core.datasets import NODE_DIR_PREFIX
from fedgpu.core.errors import FedgpuError

# The demo job's hyperparameters per task; the job's own (--hp, local_epochs) override them.
DEFAULT_HPARAMS: dict[str, dict[str, Any]] = {
    "digits": {"lr": 0.05, "momentum": 0.9, "local_epochs": 1, "batch_size": 32},
    # ResNet-20 rather than the task's ResNet-18 default: a round stays seconds, not minutes,
    # on a CPU; `--hp depth=18` (with a GPU) trains the bigger one.
    "images": {"lr": 0.05, "momentum": 0.9, "local_epochs": 1, "batch_size": 64, "depth": 20},
    # The tiny model of `fedgpu data synth-lm --out DIR`: DIR/model beside DIR/node-K.
    "causal-lm": {"model_dir": "../model", "lr": 0.001, "batch_size": 16, "seq_len": 32,
                  "local_epochs": 1},
}
# Synthetic images for `fedgpu run --task images`: per class and node, 10 classes, 32x32.
SYNTH_CLASSES = 10
SYNTH_PER_CLASS = 200


def node_dirs(task: str, out: Path, nodes: int, partition: str, alpha: float, seed: int,
              data: Path | None) -> list[Path]:
    """One data directory per node: from `data` if given, else made under `out` for `task`."""
    if data is not None:
        return existing_split(data, nodes)
    try:
        if task == "digits":
            from fedgpu.core.datasets import split_digits

            return split_digits(out, nodes, partition, alpha, seed, force=True)  # type: ignore[arg-type]
        if task == "images":
            if partition != "iid":
                raise FedgpuError(
                    "synthetic images are IID; for a non-IID run split an image folder with "
                    "'fedgpu data split-folder SRC --out DIR --partition dirichlet' and pass "
                    "--data DIR")
            from fedgpu.core.synth_images import synth_images

            return synth_images(out, nodes, classes=SYNTH_CLASSES, per_class=SYNTH_PER_CLASS,
                                seed=seed, force=True)
    except ValueError as exc:
        raise FedgpuError(str(exc)) from None
    raise FedgpuError(
        f"fedgpu run makes data for the digits and images tasks only; for task {task!r} pass "
        f"--data DIR with one directory per node ({NODE_DIR_PREFIX}1 .. {NODE_DIR_PREFIX}N)")


def existing_split(data: Path, nodes: int) -> list[Path]:
    found = {p.name: p for p in Path(data).glob(f"{NODE_DIR_PREFIX}*") if p.is_dir()}
    want = [f"{NODE_DIR_PREFIX}{i}" for i in range(1, nodes + 1)]
    missing = [name for name in want if name not in found]
    if missing:
        raise FedgpuError(
            f"--data {data} has no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
            f"for {nodes} node(s) (it holds {len(found)}): use --nodes {len(found)} or make a "
            f"split with 'fedgpu data split|synth-images|split-folder --nodes {nodes}'")
    return [found[name].resolve() for name in want]


def parse_hparams(pairs: list[str]) -> dict[str, Any]:
    """`--hp KEY=VALUE` pairs: VALUE is read as JSON (8, 0.1, true, "bf16"), else as a string."""
    import json

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise FedgpuError(f"--hp takes KEY=VALUE (e.g. --hp depth=20), got {pair!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        if not isinstance(value, bool | int | float | str):
            raise FedgpuError(f"--hp {key}: a number, true/false or a string, got {raw!r}")
        out[key.strip()] = value
    return out
