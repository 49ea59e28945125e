"""`fedgpu run --cross-site`: after the run's training job, a cross-site job (mode =
"cross-site") on the same local federation scores the global model and each node's local model
on every node's held-out data, and the run prints the matrix.

The nodes of `fedgpu run` are all the person's own, on one machine: the run gives them a site
policy that shares their local models (`share_local_model = true`, in the run directory). On a
real federation each site decides that itself (docs/how-to/cross-site-evaluation.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedgpu.core.constants import Mode
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Job

POLICY_FILE = "share-local-model.toml"


def check(job: Job) -> None:
    """ConfigError unless the run's job is one a cross-site job can follow."""
    if job.mode not in (Mode.STAR, Mode.ASYNC, Mode.RING):
        raise ConfigError(f"--cross-site compares the models of a training job; the job's "
                          f"mode is {job.mode!r}")
    if job.task_dir is not None:
        raise ConfigError("--cross-site needs an installed task (the follow-up job brings no "
                          "task bundle); use 'fedgpu job submit' for a bundled task")


def policy(run_dir: Path) -> Path:
    """The local nodes' policy: they share their local models."""
    path = run_dir / POLICY_FILE
    path.write_text("# fedgpu run --cross-site: every node here is yours\n"
                    "share_local_model = true\n")
    return path


def job_toml(job: Job, training_id: str) -> str:
    """The follow-up job: the training job's task and sites, scored rather than trained."""
    keys: dict[str, Any] = {
        "task": job.task, "name": f"cross-site of {training_id}", "mode": Mode.CROSS_SITE.value,
        "model_from_job": training_id, "min_nodes": job.min_nodes,
        "use_gpu": job.use_gpu, "round_deadline_s": job.round_deadline_s, "seed": job.seed}
    lines = [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    if job.hyperparameters:  # the model the task builds (its size, say) must fit the weights
        lines += ["", "[hyperparameters]",
                  *(f"{k} = {json.dumps(v)}" for k, v in job.hyperparameters.items())]
    return "\n".join(lines) + "\n"


def submit(address: str, token: str, job: Job) -> str:
    """Queue the follow-up of the aggregator's one job (the run's); its id."""
    from fedgpu.core import admin_client

    jobs = admin_client.query(address, token, "ListJobs", 10)
    if len(jobs) != 1:
        raise ConfigError(f"expected the run's one training job on its aggregator, found "
                          f"{len(jobs)}")
    doc = admin_client.submit_job(address, token, job_toml(job, jobs[0]["job_id"]),
                                  "cross-site.toml")
    return str(doc["job_id"])


def round_line(r: dict[str, Any]) -> str | None:
    """A round of the cross-site job as `fedgpu run` shows it; None for any other round."""
    part = r.get("cross_site")
    if not isinstance(part, dict):
        return None
    if part.get("stage") == "collect":
        sent = ", ".join(part.get("sent") or ()) or "none"
        return f"cross-site round {r['round']}: local models from {sent}"
    model = part.get("model")
    what = "the global model" if model == "global" else f"{model}'s local model"
    acc = (r.get("eval") or {}).get("accuracy")
    return (f"cross-site round {r['round']}: {what} scored by {r.get('nodes_reporting')} "
            f"node(s)" + (f", accuracy {acc:.4f}" if isinstance(acc, int | float) else ""))
