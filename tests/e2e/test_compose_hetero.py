"""The `hetero` compose profile (one node of each kind) runs a time-budgeted FedNova job end
to end: compose/job-hetero.toml, `local_work = "time"`, on a real Docker engine.

On a host without the NVIDIA Container Toolkit the GPU services start without their device
reservation (tests/e2e/no-gpu.override.yaml; with it, compose would refuse the whole project):
the --gpu enforce node then exits at start naming the toolkit, and the two others train the
job. On a host with the toolkit the project runs as shipped and all three train.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from .admin import FEDERATION_TIMEOUT_S, TOOLKIT_HINT, admin, exited, job_cli, wait_for
from .dockerutil import COMPOSE_DIR, NO_GPU_FILE, ComposeProject

pytestmark = pytest.mark.e2e

JOB_FILE = COMPOSE_DIR / "job-hetero.toml"
ENDED = ("finished", "failed", "stopped")


def gpu_toolkit_on_host() -> bool:
    """What compose/compose.sh checks before a GPU profile: the toolkit's hook or CLI."""
    return any(shutil.which(t) for t in ("nvidia-container-runtime-hook",
                                         "nvidia-container-cli"))


def test_hetero_profile_runs_a_time_budgeted_fednova_job(compose_project) -> None:
    from fedgpu.core.job import load_job

    job = load_job(JOB_FILE)
    budget = job.hetero.round_train_s
    assert job.hetero.local_work == "time" and job.strategy == "fednova" and budget

    gpu_host = gpu_toolkit_on_host()
    project: ComposeProject = compose_project(files=[] if gpu_host else [NO_GPU_FILE])
    # Relative to compose/, as a reader would write it (compose.yaml mounts it as the job).
    project.env["FEDGPU_JOB"] = f"./{Path(JOB_FILE).name}"
    t0 = time.monotonic()
    project.compose("up", "-d", "--no-build", profiles=["hetero"], timeout=300)

    training = {"node-cpu-1", "node-gpu-offered-1"}
    if gpu_host:
        training.add("node-gpu-enforced-1")
    else:
        enforced = wait_for("node-gpu-enforced-1 to exit",
                            lambda: exited(project, "node-gpu-enforced-1"), 120)
        assert enforced["ExitCode"] != 0, enforced
        assert TOOLKIT_HINT in project.logs("node-gpu-enforced-1")

    def ended() -> list[dict[str, Any]] | None:
        listed = job_cli(project, "list")
        return listed if listed and all(j["state"] in ENDED for j in listed) else None

    (done,) = wait_for("the hetero job to end", ended, FEDERATION_TIMEOUT_S)
    elapsed = time.monotonic() - t0
    assert done["name"] == "digits-hetero" and done["state"] == "finished", done

    doc = admin(project, "rounds")
    assert doc is not None and doc["job_id"] == done["job_id"]
    finished = [r for r in doc["rounds"] if r["status"] == "finished"]
    assert [r["round"] for r in finished] == list(range(1, job.rounds + 1)), doc["rounds"]
    for rec in finished:
        by_node = {u["node"]: u for u in rec["updates"]}
        # At least min_nodes; on a GPU host the enforced node may join from round 2 on.
        assert {"node-cpu-1", "node-gpu-offered-1"} <= set(by_node) <= training, rec
        for name, update in by_node.items():
            metrics, used = update["train_metrics"], update["resources"]
            # What the how-to tells operators to read: steps, examples, examples_per_s.
            # Metrics travel as floats; a count of optimizer steps is still a whole number.
            assert metrics["steps"] > 0 and float(metrics["steps"]).is_integer(), (name, metrics)
            assert metrics["examples"] > 0 and metrics["examples_per_s"] > 0, (name, metrics)
            # Equal time, not equal epochs: each site trained for the budget (epochs of the
            # ~480-example partition take a fraction of it), and not far past it.
            assert 0.9 * budget <= used["train_seconds"] <= budget + 30, (name, used)
        print(f"round {rec['round']}: steps " + ", ".join(
            f"{n} {u['train_metrics']['steps']}" for n, u in sorted(by_node.items())))
    print(f"hetero job ({'GPU host' if gpu_host else 'no GPU'}): {len(finished)} rounds in "
          f"{elapsed:.0f}s from `compose up`")
