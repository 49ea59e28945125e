"""The cpu profile run to completion (three nodes, the aggregator healthy) and the job modes
beyond training on a compose fleet (images as built), submitted from the host with `fedgpu job
submit`: a one-round training job that keeps the model's head on each site (local_params; each
node keeps it in its state volume), an evaluate job scoring its model (model_from_job), a
statistics job and a cross-site job; the aggregator container records each job as an MLflow
run in a file store on the host (compose/tracking.yaml), read back with MLflow's own client.
Skips, saying why, without an engine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from .admin import FEDERATION_TIMEOUT_S, admin, job_cli, wait_for
from .dockerutil import TRACKING_FILE, ComposeProject

pytestmark = pytest.mark.e2e
mlflow = pytest.importorskip("mlflow", reason="fedgpu[tracking] (MLflow) is not installed")

NODES = ["node-cpu-1", "node-cpu-2", "node-cpu-3"]
ENDED = ("finished", "failed", "stopped")


def test_evaluate_and_statistics_jobs_and_mlflow_runs_through_compose(
        compose_project, tmp_path: Path) -> None:
    # One round of digits keeps the first job short; the example job's keys otherwise, and
    # the head kept on each site.
    job = tmp_path / "job.toml"
    job.write_text('task = "digits"\nrounds = 1\nmin_nodes = 3\nround_deadline_s = 240\n'
                   'use_gpu = false\nseed = 0\nlocal_params = ["fc2.*"]\n\n'
                   '[hyperparameters]\nlr = 0.05\nlocal_epochs = 1\nbatch_size = 32\n')
    job.chmod(0o644)
    store = tmp_path / "mlruns"
    store.mkdir()
    store.chmod(0o777)  # the aggregator writes as UID 10001
    project: ComposeProject = compose_project(files=[TRACKING_FILE])
    project.env.update(FEDGPU_JOB=str(job), FEDGPU_TRACKING_DIR=str(store))
    t0 = time.monotonic()
    project.compose("up", "-d", "--no-build", profiles=["cpu"], timeout=300)
    print(f"up: {time.monotonic() - t0:.0f}s")

    def ended(job_id: str):
        def probe() -> dict[str, Any] | None:
            doc = job_cli(project, "status", job_id)
            return doc if doc["state"] in ENDED else None
        return probe

    listed = wait_for("the first job", lambda: job_cli(project, "list") or None, 180)
    trained = wait_for("the training job to end", ended(listed[0]["job_id"]),
                       FEDERATION_TIMEOUT_S)
    assert trained["state"] == "finished", trained
    print(f"training job ended: {time.monotonic() - t0:.0f}s")
    # The cpu profile as a whole (this test is also its run to completion): the split ran
    # once, every node decided on the CPU and trained, the aggregator is healthy.
    split = project.container("data-split")
    assert split["State"] == "exited" and split["ExitCode"] == 0, split
    nodes = {n["name"]: n for n in admin(project, "nodes")["nodes"]}
    assert set(nodes) == set(NODES), nodes
    for node in nodes.values():
        assert node["gpu_decision"]["device"] == "cpu", node
        assert node["rounds_completed"] >= 1, node
    aggregator = project.container("aggregator")
    assert aggregator["State"] == "running" and aggregator.get("Health") == "healthy", aggregator
    for node in NODES:  # each site's own head, in its state volume
        kept = project.compose("exec", "-T", node, "sh", "-c",
                               "ls /var/lib/fedgpu/node/identity/named/*/local-params/").stdout
        assert "local-params-" in kept, (node, kept)

    evaluate = tmp_path / "evaluate.toml"
    evaluate.write_text(f'task = "digits"\nmode = "evaluate"\nmodel_from_job = '
                        f'"{trained["job_id"]}"\nmin_nodes = 3\nuse_gpu = false\n')
    stats = tmp_path / "statistics.toml"
    stats.write_text('task = "digits"\nmode = "statistics"\nmin_nodes = 3\nuse_gpu = false\n\n'
                     '[statistics]\nmin_count = 5\n')
    # Cross-site: the compose nodes run without a site policy, so each keeps its local model
    # (the safe default) and says why; the global model is scored on every site.
    cross = tmp_path / "cross-site.toml"
    cross.write_text(f'task = "digits"\nmode = "cross-site"\nmodel_from_job = '
                     f'"{trained["job_id"]}"\nmin_nodes = 3\nuse_gpu = false\n')
    ids = [job_cli(project, "submit", str(p))["job_id"] for p in (evaluate, stats, cross)]
    done = [wait_for(f"job {i} to end", ended(i), FEDERATION_TIMEOUT_S) for i in ids]
    assert [d["state"] for d in done] == ["finished"] * 3, done
    matrix = done[2]["cross_site"]
    rows = {r["model"]: r for r in matrix["rows"]}
    assert sorted(rows["global"]["cells"]) == NODES, matrix
    assert all(0 < c["accuracy"] <= 1 for c in rows["global"]["cells"].values()), matrix
    assert all(rows[n]["why_not"] for n in NODES), matrix
    print(f"evaluate and statistics jobs ended: {time.monotonic() - t0:.0f}s")

    ev = done[0]["evaluation"]
    assert sorted(e["node"] for e in ev["per_node"]) == NODES, ev
    assert 0 < ev["accuracy"] <= 1 and ev["num_examples"] > 0, ev
    released = done[1]["statistics"]
    assert sorted(released["sites"]) == NODES and released["release"]["min_count"] == 5
    combined = released["combined"]
    assert combined["label"]["count"] == sum(
        s["label"]["count"] for s in released["sites"].values()) > 0, released
    assert 0 <= combined["label"]["mean"] <= 9

    # One MLflow run per job, written by the container into the mounted store.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=f"file:{store / 'store'}")

    def runs() -> dict[str, Any] | None:
        exp = client.get_experiment_by_name("fedgpu")
        if exp is None:
            return None
        found = {r.data.tags.get("fedgpu.job_id"): r
                 for r in client.search_runs([exp.experiment_id])}
        ended_runs = [r for r in found.values() if r.info.status == "FINISHED"]
        return found if len(ended_runs) == 4 else None

    by_job = wait_for("four finished MLflow runs", runs, 90)
    print(f"runs read back: {time.monotonic() - t0:.0f}s")
    assert set(by_job) == {trained["job_id"], *ids}, by_job
    train_run = by_job[trained["job_id"]]
    assert train_run.data.params["task"] == "digits" and train_run.data.params["rounds"] == "1"
    loss = client.get_metric_history(train_run.info.run_id, "train_loss")
    assert [m.step for m in loss] == [1], loss
    assert list(store.rglob("global.safetensors")), "the final model as an artifact"
