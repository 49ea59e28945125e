"""`fedgpu task new|check`: write a task bundle directory, and check it as a node would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.tls_options import AsJson
from fedgpu.core.errors import ConfigError

task_app = typer.Typer(help="Your own task as a bundle shipped with jobs: write one, check it.",
                       no_args_is_help=True)


@task_app.command("new")
def new(name: Annotated[str, typer.Argument(help="The task's name (what jobs say).")],
        directory: Annotated[Path | None, typer.Option(
            "--dir", help="Where to write it (default: ./NAME); must not exist yet.")] = None
        ) -> None:
    """Write a working task directory: manifest and a small PyTorch model to change."""
    from fedgpu.cli import task_template
    from fedgpu.core.bundles import BundleError, parse_manifest

    target = directory or Path(name)
    try:
        parse_manifest(task_template.MANIFEST.format(
            name=name, package=task_template.package_name(name),
            cls=task_template.class_name(name)))
    except BundleError as exc:
        raise ConfigError(f"cannot name a task {name!r}: {exc}") from None
    if target.exists():
        raise ConfigError(f"{target} exists already; pick another --dir")
    for rel, text in task_template.files(name).items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    typer.echo(f"wrote task {name!r} in {target}/\n"
               f"  check it:  fedgpu task check {target}\n"
               f"  a job for it (job.toml beside {target}/):\n\n"
               + task_template.JOB.format(name=name, path=target.as_posix()))


@task_app.command("check")
def check(task_dir: Annotated[Path, typer.Argument(help="The task directory.")],
          data: Annotated[Path | None, typer.Option(
              help="Run on this node data directory instead of generated digits-shaped "
                   "data.")] = None,
          hyperparameters: Annotated[str, typer.Option(
              "--hyperparameters", help="The job's [hyperparameters], as a JSON object.")]
          = "{}",
          timeout: Annotated[float, typer.Option(help="Seconds each round may take.")] = 300,
          as_json: AsJson = False) -> None:
    """Pack the task as a job would, import it in a worker process as a node would, build the
    model, train and evaluate on the CPU; print the sha256 sites approve."""
    from fedgpu.cli import task_check

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


def register(app: typer.Typer) -> None:
    app.add_typer(task_app, name="task")
