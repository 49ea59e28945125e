"""Reading a job file: the one reader the CLI, `server start --job` and `fedgpu run` use.

`read_job_file` gives the file's text (what `job submit` sends), the validated Job and the
paths it names relative to the file (its task bundle directory, its initial weights), so no
caller peeks into the TOML with rules of its own.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedgpu.core.errors import ConfigError
from fedgpu.core.job.job import Job, parse_job

# A job file is a page of settings; anything larger is a mistake or an attack.
MAX_JOB_FILE_BYTES = 256 << 10


@dataclass(frozen=True)
class JobFile:
    path: Path
    text: str
    job: Job

    @property
    def task_dir(self) -> Path | None:
        """The job's task bundle directory, relative to the job file."""
        return self.path.parent / self.job.task_dir if self.job.task_dir else None

    @property
    def initial_weights(self) -> Path | None:
        """The job's initial weights file, relative to the job file (`job submit` uploads it:
        the aggregator reads no path a job names)."""
        return (self.path.parent / self.job.initial_weights
                if self.job.initial_weights and self.job.initial_weights.strip() else None)


def read_text(path: Path) -> str:
    """The job file's text, bounded; ConfigError when missing, unreadable or too large."""
    try:
        size = path.stat().st_size
        if size > MAX_JOB_FILE_BYTES:
            raise ConfigError(f"job file {path} is {size} bytes; the limit is "
                              f"{MAX_JOB_FILE_BYTES}")
        return path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"job file {path} does not exist (see examples/job.toml)") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"cannot read job file {path}: {why}") from None


def read_job_file(path: Path) -> JobFile:
    """The job file at `path`, validated (ConfigError naming the key)."""
    text = read_text(path)
    return JobFile(path, text, parse_job(loads_toml(text, str(path)), str(path)))


def load_job(path: Path) -> Job:
    return read_job_file(path).job


def loads_toml(text: str, source: str = "job") -> dict[str, Any]:
    """A job file's TOML, or ConfigError: nesting too deep for the parser (tomllib recurses)
    is a refusal like any syntax error, never a crash of the caller."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid TOML: tables or arrays nested too deep") \
            from None
    except ValueError as exc:  # tomllib lets int()'s own refusals through (4,300+ digits)
        raise ConfigError(f"{source}: not valid TOML: {str(exc)[:200]}") from None


def dumps_job(job: Job) -> str:
    """The job as a job file (TOML) that parses back to an equal Job: what `fedgpu run` hands
    its aggregator (`server start --job`), built from a Job, never from strings of its own."""
    # Enums become their values, tuples lists; None (TOML has none) means "absent", and so
    # does the empty task of a job its bundle names.
    values = json.loads(json.dumps(job.to_dict()))
    if not values["task"]:
        del values["task"]
    return _table(values, ())


def _table(values: dict[str, Any], path: tuple[str, ...]) -> str:
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append((name, value))
        else:
            lines.append(f"{_key(name)} = {_value(value)}")
    out = ""
    if path:
        out += f"\n[{'.'.join(_key(p) for p in path)}]\n"
    out += "".join(line + "\n" for line in lines)
    for name, table in tables:
        if table:
            out += _table(table, (*path, name))
    return out


def _key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
