"""`fedgpu task new`: write a task bundle directory to start from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedgpu.core.errors import ConfigError


def new(name: Annotated[str, typer.Argument(help="The task's name (what jobs say).")],
        directory: Annotated[Path | None, typer.Option(
            "--dir", help="Where to write it (default: ./NAME); must not exist yet.")] = None
        ) -> None:
    """Write a working task directory (manifest and a small PyTorch model to change) and a job
    file for it beside the directory (job.toml, or NAME-job.toml when job.toml exists).

    Example: fedgpu task new my-task
    """
    from fedgpu.cli.task import template as task_template
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
    # The job file goes beside the task directory, naming it relatively; an existing job.toml
    # there is never overwritten.
    job = target.parent / "job.toml"
    if job.exists():
        job = target.parent / f"{target.name}-job.toml"
    if job.exists():
        raise ConfigError(f"wrote task {name!r} in {target}/, but {job} exists already: no job "
                          "file written")
    job.write_text(task_template.JOB.format(name=name, path=target.name))
    typer.echo(f"wrote task {name!r} in {target}/ and a job for it in {job}\n"
               f"  check it:   fedgpu task check {target}\n"
               f"  submit it:  fedgpu job submit {job}")
