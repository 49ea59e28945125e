"""Each job as one MLflow run (`fedgpu server start --tracking-uri`), read back with MLflow's
own client: parameters from the job file, a point per round, per-site metrics, the model and
the rounds document as artifacts, the end state; a restart continues the same run."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.fixtures.federation import Federation, write_job

mlflow = pytest.importorskip("mlflow", reason="fedgpu[tracking] (MLflow) is not installed")
ROUNDS = 40


def _run_of(uri: str):
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("fedgpu")
    assert exp is not None, "no 'fedgpu' experiment"
    runs = client.search_runs([exp.experiment_id])
    return client, runs


def _logged_rounds(uri: str) -> set[int]:
    try:
        client, runs = _run_of(uri)
    except AssertionError:
        return set()
    if not runs:
        return set()
    return {m.step for m in client.get_metric_history(runs[0].info.run_id, "train_loss")}


def test_a_job_is_one_mlflow_run(federation: Federation, digits_split: list[Path],
                                 tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = write_job(tmp_path / "job.toml", rounds=3, name="tracked")
    agg = federation.start_server(job, "--state-dir", str(tmp_path / "state"),
                                  "--operator-token", federation.operator_token,
                                  "--tracking-uri", uri)
    for i in range(2):
        federation.start_node(f"node-{i}", digits_split[i])
    federation.wait_state(("finished", "failed"), timeout=300)
    job_id = federation.query("ListJobs")[0]["job_id"]
    # The follower finishes the run within a poll or two of the job's end.
    agg.popen.send_signal(signal.SIGTERM)
    agg.popen.wait(timeout=60)

    client, runs = _run_of(uri)
    assert len(runs) == 1, agg.text()[-3000:]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["fedgpu.job_id"] == job_id
    assert run.data.params["rounds"] == "3" and run.data.params["task"] == "digits"
    assert run.data.params["hyperparameters.lr"] == "0.05"
    loss = client.get_metric_history(run.info.run_id, "train_loss")
    assert sorted(m.step for m in loss) == [1, 2, 3]
    acc = client.get_metric_history(run.info.run_id, "eval_accuracy")
    assert {m.step for m in acc} >= {0, 1, 2}
    assert 0 <= max(m.value for m in acc) <= 1
    assert client.get_metric_history(run.info.run_id, "site.node-0.train_loss")
    assert client.get_metric_history(run.info.run_id, "site.node-1.rss_peak_mib")
    files = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert "rounds.json" in files and "model" in files
    model = {f.path for f in client.list_artifacts(run.info.run_id, "model")}
    assert model == {"model/global.safetensors"}
    # Beside the store, not in the aggregator's working directory.
    assert (tmp_path / "mlflow-artifacts").is_dir()
    assert list((tmp_path / "mlflow-artifacts").rglob("global.safetensors"))


def test_a_restart_continues_the_same_run(federation: Federation, digits_split: list[Path],
                                          tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # Rounds enough that the job is still running when the run holds its second one (a
    # digits round takes ~0.2 s; the store is polled every second).
    job = write_job(tmp_path / "job.toml", rounds=ROUNDS)
    state = tmp_path / "state"
    agg = federation.start_server(job, "--state-dir", str(state), "--operator-token",
                                  federation.operator_token, "--tracking-uri", uri)
    end = time.monotonic() + 240
    # Read the store only once the aggregator made it: two processes creating one sqlite
    # store's tables at once collide in MLflow's migrations. The nodes start only then: the
    # store opens in the background, seconds after the start, and on a loaded machine the
    # job's 40 quick rounds could all be over before it did.
    while time.monotonic() < end and "tracking jobs as MLflow runs" not in agg.text():
        time.sleep(0.5)
    for i in range(2):
        federation.start_node(f"node-{i}", digits_split[i])
    # Stop once the run holds the second round: the run stays open for the next start.
    while time.monotonic() < end and not _logged_rounds(uri) >= {1, 2}:
        time.sleep(0.5)
    agg.popen.send_signal(signal.SIGTERM)
    agg.popen.wait(timeout=60)
    client, runs = _run_of(uri)
    assert len(runs) == 1 and runs[0].info.status == "RUNNING"

    federation.restart_server()
    for i, node in enumerate(p for p in list(federation.procs) if p.name.startswith("node-")):
        if node.popen.poll() is not None:  # a node that took the stop for the run's end
            federation.start_node(node.name, digits_split[i])
    federation.wait_state(("finished", "failed"), timeout=300)
    federation.stop()
    client, runs = _run_of(uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "train_loss")]
    assert sorted(steps) == list(range(1, ROUNDS + 1)), "a round logged twice or lost"


def test_a_store_that_cannot_be_opened_stops_the_start_with_the_reason(tmp_path: Path) -> None:
    from tests.fixtures.federation import FEDGPU, base_env, free_port

    proc = subprocess.run(
        [*FEDGPU, "server", "start", "--insecure", "--port", str(free_port()), "--state-dir",
         str(tmp_path / "state"), "--tracking-uri", "nosuchscheme://x"],
        capture_output=True, text=True, timeout=120, env=base_env())
    assert proc.returncode != 0
    assert "--tracking-uri nosuchscheme://x: not an MLflow tracking store" in (
        proc.stderr + proc.stdout)


def test_fedgpu_run_tracks_its_job_with_the_report(tmp_path: Path) -> None:
    from tests.fixtures.federation import FEDGPU, base_env

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.run(
        [*FEDGPU, "run", "--nodes", "2", "--rounds", "2", "--gpu", "none", "--run-dir",
         str(tmp_path / "run"), "--tracking-uri", uri],
        capture_output=True, text=True, timeout=600, env=base_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"is an MLflow run at {uri} (report added)" in proc.stdout
    client, runs = _run_of(uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    assert sorted(m.step for m in client.get_metric_history(run_id, "train_loss")) == [1, 2]
    report = {f.path for f in client.list_artifacts(run_id, "report")}
    assert {"report/global.png", "report/summary.md"} <= report
