"""One MLflow run per job, written through MLflow's own client (blocking calls: the follower
makes them off the event loop).

A job keeps its run across aggregator restarts: the run carries the tag `fedgpu.job_id` and
is found again by it, and points already logged are not logged twice (MLflow would keep both).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedgpu.core.errors import ConfigError
from fedgpu.server.tracking import round_metrics

EXPERIMENT = "fedgpu"
JOB_TAG = "fedgpu.job_id"
# MLflow's run states for how a job ended.
_END = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


def client(uri: str) -> Any:
    """MLflow's client for `uri` (sqlite:///PATH, file:PATH, http(s)://server), or a clear
    error when MLflow is not installed."""
    try:
        from mlflow import MlflowClient
    except ImportError:
        raise ConfigError("--tracking-uri needs MLflow on the aggregator: pip install "
                          "'fedgpu[tracking]'") from None
    if uri.startswith("file:"):
        # MLflow 3 keeps its file store for those who ask for it by name; a `file:` URI does.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def artifact_root(uri: str) -> str | None:
    """Where a local store's artifacts go: beside its database (MLflow's default for a sqlite
    store is ./mlruns of whatever directory the aggregator was started in); None: the store's
    own default (a tracking server decides, a file store keeps them inside itself)."""
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(uri.removeprefix("sqlite:///")).resolve()
    return (database.parent / f"{database.stem}-artifacts").as_uri()


class MlflowRuns:
    def __init__(self, uri: str) -> None:
        self.client = client(uri)
        found = self.client.get_experiment_by_name(EXPERIMENT)
        self.experiment = (found.experiment_id if found is not None
                           else self.client.create_experiment(
                               EXPERIMENT, artifact_location=artifact_root(uri)))
        self._logged: dict[str, set[tuple[str, int]]] = {}

    def run_for(self, job_id: str, name: str, job: Mapping[str, Any]) -> str:
        """The job's run: found by its tag, else created with the job's settings as params."""
        runs = self.client.search_runs([self.experiment],
                                       filter_string=f"tags.`{JOB_TAG}` = '{job_id}'",
                                       max_results=1)
        if runs:
            run_id = runs[0].info.run_id
            self._logged[run_id] = {(k, int(m.step)) for k in runs[0].data.metrics
                                    for m in self.client.get_metric_history(run_id, k)}
            return run_id
        run = self.client.create_run(self.experiment, run_name=f"{name} ({job_id[:8]})",
                                     tags={JOB_TAG: job_id, "fedgpu.task": str(job.get("task"))})
        flat = round_metrics.params(job)
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(flat.items())]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(run.info.run_id, params=items[i:i + 100])
        self._logged[run.info.run_id] = set()
        return str(run.info.run_id)

    def log_rounds(self, run_id: str, doc: Mapping[str, Any]) -> int:
        """The document's points not logged yet; how many went out."""
        from mlflow.entities import Metric

        done = self._logged.setdefault(run_id, set())
        fresh = [(k, v, s) for k, v, s in round_metrics.points(doc) if (k, s) not in done]
        stamp = int(time.time() * 1000)
        batch = [Metric(k, v, stamp, s) for k, v, s in fresh]
        for i in range(0, len(batch), 1000):  # MLflow's batch limit
            self.client.log_batch(run_id, metrics=batch[i:i + 1000])
        done.update((k, s) for k, _, s in fresh)
        return len(fresh)

    def finish(self, run_id: str, state: str, doc: Mapping[str, Any],
               model: Path | None, reason: str | None = None) -> None:
        """The last points, the model and the rounds document as artifacts, the end state."""
        self.log_rounds(run_id, doc)
        with tempfile.TemporaryDirectory() as tmp:
            rounds = Path(tmp) / "rounds.json"
            rounds.write_text(json.dumps(doc, indent=2))
            self.client.log_artifact(run_id, str(rounds))
        if model is not None and model.exists():
            self.client.log_artifact(run_id, str(model), artifact_path="model")
        if reason:
            self.client.set_tag(run_id, "fedgpu.end_reason", reason[:5000])
        self.client.set_terminated(run_id, status=_END.get(state, "FINISHED"))

    def add_artifacts(self, job_id: str, paths: list[Path], artifact_path: str) -> bool:
        """Files made after the job (`fedgpu run`'s report) into its run, if it has one."""
        runs = self.client.search_runs([self.experiment],
                                       filter_string=f"tags.`{JOB_TAG}` = '{job_id}'",
                                       max_results=1)
        if not runs:
            return False
        for path in paths:
            self.client.log_artifact(runs[0].info.run_id, str(path),
                                     artifact_path=artifact_path)
        return True
