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
    """Write a working task directory: manifest and a small PyTorch model to change.

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
    typer.echo(f"wrote task {name!r} in {target}/\n"
               f"  check it:  fedgpu task check {target}\n"
               f"  a job for it (job.toml beside {target}/):\n\n"
               + task_template.JOB.format(name=name, path=target.as_posix()))
