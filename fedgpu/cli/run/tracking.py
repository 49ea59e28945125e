"""`fedgpu run --tracking-uri`: the aggregator records the job as an MLflow run
(server/tracking/); once the run is over, its report's plots join that run as artifacts."""

from __future__ import annotations

from pathlib import Path


def add_report(uri: str, run_dir: Path, job_id: str) -> str:
    """The report of `run_dir/rounds.json` written to `run_dir/report` and added to the job's
    MLflow run; what to tell the user."""
    rounds = run_dir / "rounds.json"
    if not rounds.exists():
        return "tracking: no rounds.json, so no report to add to the MLflow run"
    try:
        from fedgpu.cli.report import plots
    except ImportError:
        return "tracking: no report added (fedgpu report needs matplotlib: fedgpu[report])"
    from fedgpu.server.tracking.mlflow_runs import MlflowRuns

    paths = plots.write_report(plots.load_json_file(rounds), run_dir / "report")
    if not MlflowRuns(uri).add_artifacts(job_id, list(paths), "report"):
        return f"tracking: the aggregator made no MLflow run for job {job_id} at {uri}"
    return f"tracking: job {job_id} is an MLflow run at {uri} (report added)"
