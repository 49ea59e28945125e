"""Three nodes, five FedAvg rounds of the digits task through the runner, averaged in numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.core.datasets import split_digits
from fedgpu.node import weights
from fedgpu.node.rounds import runner
from fedgpu.node.rounds.workfiles import WEIGHTS_IN, WEIGHTS_OUT

NODES, ROUNDS = 3, 5


def _round(workdir: Path, kind: str, data_dir: Path, seed: int, global_model: dict | None):
    workdir.mkdir(parents=True)
    if global_model is not None:
        weights.write_weights(workdir / WEIGHTS_IN, global_model)
    spec = runner.parse_spec(
        {
            "kind": kind,
            "task_name": "digits",
            "hyperparameters": {},  # the defaults are what must reach 0.90
            "seed": seed,
            "round": 0,
            "data_dir": str(data_dir),
            "device": "cpu",
            "memory_fraction": None,
            "torch_threads": 1,
        }
    )
    result = runner.run_round(spec, workdir)
    out = workdir / WEIGHTS_OUT
    return result, (codec.decode(out.read_bytes())[0] if out.exists() else None)


def _fedavg(updates: list[tuple[int, dict[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    total = sum(n for n, _ in updates)
    names = updates[0][1]
    return {
        k: (sum(n * u[k].astype(np.float64) for n, u in updates) / total).astype(np.float32)
        for k in names
    }


@pytest.mark.timeout(120)
def test_fedavg_reaches_90_percent_on_iid_digits(tmp_path: Path) -> None:
    dirs = split_digits(tmp_path / "data", NODES, "iid", seed=0)
    _, global_model = _round(tmp_path / "init", "init", dirs[0], 0, None)
    accuracy_by_round = []
    for r in range(1, ROUNDS + 1):
        updates = []
        for i, d in enumerate(dirs):
            result, update = _round(tmp_path / f"r{r}-n{i}", "train", d, 100 * r + i, global_model)
            assert update is not None
            updates.append((result.num_examples, update))
        global_model = _fedavg(updates)
        evals = [_round(tmp_path / f"e{r}-n{i}", "evaluate", d, 0, global_model)[0]
                 for i, d in enumerate(dirs)]
        accuracy_by_round.append(
            sum(e.num_eval_examples * e.eval_metrics["accuracy"] for e in evals)
            / sum(e.num_eval_examples for e in evals)
        )
    assert accuracy_by_round[-1] >= 0.90, accuracy_by_round
    assert accuracy_by_round[-1] > accuracy_by_round[0]
