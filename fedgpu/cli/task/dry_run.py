"""`fedgpu task check DIR`: run a task bundle the way a node would, on the CPU, before any site
sees it.

The directory is packed exactly as `fedgpu job submit --task-dir` packs it (so the hash printed
is the one sites approve), every check a node makes is made, and then three rounds run in
fresh `python -m fedgpu.node.rounds.worker` processes, each handed the archive and its hash as a
node's
agent hands them: init (build the model), train (evaluate the received model, then train on it)
and evaluate. The data is generated in the node's data-directory format (what `fedgpu data split`
writes: `x` float32 [N, 1, 8, 8], `y` int64 in 0..9), or a real node data directory (`--data`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core import codec
from fedgpu.core.bundle_requires import unmet_requirements
from fedgpu.core.bundles import Bundle, pack_dir
from fedgpu.core.datasets import TEST_FILE, TRAIN_FILE
from fedgpu.core.errors import FedgpuError

# One batch of the template's default size trains one step; a held-out set to score.
TRAIN_EXAMPLES = 32
TEST_EXAMPLES = 16
KINDS = ("init", "train", "evaluate")


class CheckFailed(FedgpuError):
    exit_code = 1


@dataclass
class CheckReport:
    bundle: Bundle
    rounds: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        m = self.bundle.manifest
        return {"name": m.name, "entry": m.entry, "requires": list(m.requires),
                "sha256": self.bundle.sha256, "size": self.bundle.size,
                "files": sorted(self.bundle.files), "rounds": self.rounds,
                "approve": f"fedgpu node approve {self.bundle.sha256}"}


def generate_data(directory: Path, seed: int = 0) -> Path:
    """A node data directory of random digits-shaped examples."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for filename, n in ((TRAIN_FILE, TRAIN_EXAMPLES), (TEST_FILE, TEST_EXAMPLES)):
        x = rng.random((n, 1, 8, 8), dtype=np.float32)
        y = rng.integers(0, 10, size=n, dtype=np.int64)
        encoded = codec.encode({"x": x, "y": y}, {"dataset": "generated", "split": filename})
        with open(directory / filename, "wb") as fh:
            for segment in encoded.segments:
                fh.write(segment)
    return directory


def check(task_dir: Path, data: Path | None = None, hyperparameters: dict[str, Any] | None = None,
          timeout_s: float = 300.0) -> CheckReport:
    """Pack, check and run the task; CheckFailed (or a BundleError) says what went wrong."""
    bundle = pack_dir(task_dir)
    unmet = unmet_requirements(bundle.manifest.requires)
    if unmet:
        raise CheckFailed(f"task {bundle.manifest.name!r} requires what this environment "
                          f"lacks: {'; '.join(unmet)}")
    report = CheckReport(bundle)
    with tempfile.TemporaryDirectory(prefix="fedgpu-task-check-") as tmp:
        root = Path(tmp)
        archive = root / f"{bundle.sha256}.tar"
        archive.write_bytes(bundle.data)
        data_dir = data.resolve() if data is not None else generate_data(root / "data")
        weights: Path | None = None
        for kind in KINDS:
            workdir = root / kind
            workdir.mkdir()
            if weights is not None:
                shutil.copyfile(weights, workdir / "weights.in.safetensors")
            task = {"kind": kind, "task_name": bundle.manifest.name,
                    "hyperparameters": hyperparameters or {}, "seed": 0, "round": 0,
                    "data_dir": str(data_dir), "device": "cpu", "memory_fraction": None,
                    "torch_threads": 1,
                    "bundle": {"path": str(archive), "sha256": bundle.sha256,
                               "name": bundle.manifest.name, "entry": bundle.manifest.entry}}
            (workdir / "task.json").write_text(json.dumps(task))
            report.rounds[kind] = _run_worker(workdir, root, timeout_s)
            out = workdir / "weights.out.safetensors"
            if kind != "evaluate":
                if not out.exists():
                    raise CheckFailed(f"the {kind} round wrote no weights")
                weights = out
    return report


def _run_worker(workdir: Path, cwd: Path, timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ)
    # The check runs on the CPU, as on a node without a GPU.
    env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        # cwd away from the task directory: a node's worker never finds the sources there.
        proc = subprocess.run([sys.executable, "-m", "fedgpu.node.rounds.worker", str(workdir)],
                              cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"the {workdir.name} round took longer than {timeout_s:.0f}s"
                          ) from None
    if proc.returncode != 0:
        try:
            err = json.loads((workdir / "error.json").read_text())
            why = f"{err.get('kind')}: {err.get('error')}"
        except (OSError, ValueError):
            why = f"exit status {proc.returncode}"
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise CheckFailed(f"the {workdir.name} round failed ({why})\n{tail}")
    result = json.loads((workdir / "result.json").read_text())
    return {k: result.get(k) for k in ("num_examples", "train_metrics", "eval_metrics",
                                       "num_eval_examples", "train_seconds")}
