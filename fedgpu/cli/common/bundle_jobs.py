"""Job files that name a task bundle directory (`task_dir`), as the CLI reads them."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from fedgpu.core.bundles import Bundle, pack_dir
from fedgpu.core.config import parse_job, with_bundle_task
from fedgpu.core.errors import ConfigError

_TASK_DIR_LINE = re.compile(r"^task_dir\s*=.*$", re.MULTILINE)


def task_dir_of(job_file: Path, text: str, given: Path | None = None) -> Path | None:
    """`given` (--task-dir), else the job file's `task_dir`, relative to the job file."""
    if given is not None:
        return given
    try:
        raw = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError, ValueError):
        return None  # the aggregator refuses the file, naming the problem
    value = raw.get("task_dir")
    return job_file.parent / value if isinstance(value, str) and value.strip() else None


def initial_weights_of(job_file: Path, text: str) -> Path | None:
    """The job file's `initial_weights`, relative to the job file: `job submit` uploads it
    (the aggregator reads no path a job names). None when it names none."""
    try:
        raw = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError, ValueError):
        return None  # the aggregator refuses the file, naming the problem
    value = raw.get("initial_weights")
    return job_file.parent / value if isinstance(value, str) and value.strip() else None


def with_absolute_task_dir(job_file: Path, text: str) -> tuple[str, Bundle]:
    """The job file's text with its `task_dir` made absolute (so a copy of the file elsewhere,
    as `fedgpu run` makes one, still finds it) and the bundle it packs, checked."""
    folder = task_dir_of(job_file, text)
    assert folder is not None
    bundle = pack_dir(folder)
    new_text, count = _TASK_DIR_LINE.subn(
        lambda _m: f"task_dir = {json.dumps(str(folder.resolve()))}", text)
    job = parse_job(tomllib.loads(new_text), str(job_file)) if count == 1 else None
    if job is None or job.task_dir != str(folder.resolve()):
        raise ConfigError(f"{job_file}: put task_dir = \"...\" on a line of its own, before "
                          "any [table]")
    with_bundle_task(job, bundle.manifest.name, str(job_file))  # a task naming another: refused
    return new_text, bundle
