"""`fedgpu task check`: run a task bundle as a node would, on the CPU, before any job
brings it to a site."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.common.options import AsJson
from fedgpu.core.errors import ConfigError


def check(task_dir: Annotated[Path, typer.Argument(help="The task directory.")],
          data: Annotated[Path | None, typer.Option(
              help="Run on this node data directory instead of generated digits-shaped "
                   "data.")] = None,
          hyperparameters: Annotated[str, typer.Option(
              "--hyperparameters",
              help="The job's hyperparameters table, as a JSON object, e.g. '{\"lr\": 0.1}'.")]
          = "{}",
          timeout: Annotated[float, typer.Option(help="Seconds each round may take.")] = 300,
          as_json: AsJson = False) -> None:
    """Pack the task as a job would, import it in a worker process as a node would, build the
    model, train and evaluate on the CPU; print the sha256 sites approve.

    Example: fedgpu task check my-task --hyperparameters '{"lr": 0.1}'
    """
    from fedgpu.cli.task import dry_run as task_check

    try:
        hp = json.loads(hyperparameters)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--hyperparameters is not JSON: {exc}") from None
    if not isinstance(hp, dict):
        raise ConfigError("--hyperparameters must be a JSON object")
    report = task_check.check(task_dir, data, hp, timeout)
    doc = report.to_dict()
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    lines = [f"task {doc['name']!r} ({doc['entry']}): {len(doc['files'])} files, "
             f"{doc['size']:,} bytes"]
    for kind, r in doc["rounds"].items():
        metrics = {**(r.get("eval_metrics") or {}),
                   **{f"train_{k}": v for k, v in (r.get("train_metrics") or {}).items()}}
        shown = " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())) or "model built"
        lines.append(f"  {kind:<8} ok  {shown}")
    lines += [f"sha256 {doc['sha256']}",
              f"sites approve it with: {doc['approve']}"]
    typer.echo("\n".join(lines))
