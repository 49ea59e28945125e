"""A job's initial weights: a file kept in the job's own directory from the moment it is
queued, never a path on the aggregator's host read when the job starts.

Where the bytes come from:
- `fedgpu job submit` uploads the file the job file names (Admin.SubmitJob, after the task
  bundle), bounded by the update limit (--max-update-mib);
- a name inside the directory the aggregator was started to serve (`--initial-weights-dir`),
  for models already on the aggregator's host;
- `server start --job FILE`: the host's own job file, read by whoever started the server.

Reading a path named by an operator used to freeze the aggregator (a FIFO, /dev/zero, read on
the event loop), leak a file's first bytes in the job's error and serve any readable
safetensors file through `job model`. Every read here is of a regular file only (opened
without blocking, checked with fstat on the descriptor), bounded, off the event loop (callers
run these functions in a thread), and an error about the serving directory says the same
whatever the file is, so it tells nothing about files outside what the directory holds.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path, PurePosixPath

import numpy as np

from fedgpu.core import codec
from fedgpu.core.errors import ConfigError
from fedgpu.server.rounds.checkpoint import map_weights

log = logging.getLogger("fedgpu.server.jobs.queue")

# The job's directory holds its initial weights under this name.
STORED = "initial.safetensors"
INCOMING = ".incoming"
_COPY_BLOCK = 1 << 20


class WeightsTooLarge(ConfigError):
    """Initial weights over the aggregator's update limit."""


def incoming_path(state_dir: Path) -> Path:
    """A fresh temporary name for weights being received (renamed into the job's directory
    once queued; removed on refusal)."""
    folder = state_dir / INCOMING
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{secrets.token_hex(8)}.safetensors"


def clear_incoming(state_dir: Path) -> None:
    """Leftovers of submissions cut off by a crash."""
    folder = state_dir / INCOMING
    if folder.is_dir():
        for leftover in folder.iterdir():
            leftover.unlink(missing_ok=True)


def copy_regular(source: Path, dest: Path, limit: int, what: str) -> None:
    """Copy `source` to `dest` if it is a regular file of at most `limit` bytes; ConfigError
    naming `what` otherwise. Opened with O_NONBLOCK so a FIFO cannot block the open, and
    checked on the descriptor, so what is read is what was checked."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(source, flags)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot open it ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what}: not a regular file")
        if st.st_size > limit:
            raise WeightsTooLarge(f"{what}: {st.st_size} bytes, over the aggregator's limit "
                                  f"of {limit} bytes (--max-update-mib)")
        copied = 0
        with open(dest, "wb") as out:
            while block := os.read(fd, _COPY_BLOCK):
                copied += len(block)
                if copied > limit:  # the file grew while read
                    raise WeightsTooLarge(f"{what}: over the limit of {limit} bytes")
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read it ({exc.strerror})") from None
    finally:
        os.close(fd)


def from_serving_dir(directory: Path | None, name: str, dest: Path, limit: int) -> None:
    """Copy the file `name` of the aggregator's initial-weights directory to `dest`.

    One message for every failure (missing, a directory, a link out of it, too large, not
    safetensors): the operator learns that this name is not a model the directory serves,
    and nothing else about the host's files."""
    refusal = ConfigError(
        f"initial_weights {name[:200]!r}: the aggregator serves no safetensors file of at most "
        f"{limit} bytes by that name (a job's initial weights come with 'fedgpu job submit', "
        "which uploads the file, or name a file in the directory the aggregator was started "
        "with: --initial-weights-dir)")
    if directory is None:
        raise ConfigError(
            f"initial_weights {name[:200]!r}: this aggregator reads no files named by a job; "
            "submit the job with 'fedgpu job submit', which uploads the file, or start the "
            "aggregator with --initial-weights-dir DIR and name a file in DIR")
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts or "\\" in name or "\0" in name:
        raise refusal
    root = directory.resolve()
    target = (root / rel).resolve()
    # A link inside the directory that points out of it is refused like a `..`.
    if root not in target.parents:
        raise refusal
    try:
        copy_regular(target, dest, limit, "initial_weights")
        check(dest, "initial_weights")
    except ConfigError:
        dest.unlink(missing_ok=True)
        raise refusal from None


def check(path: Path, what: str) -> None:
    """ConfigError unless `path` is a valid safetensors file (the operator's own bytes: the
    codec's reason is worth showing). Empty or unreadable is the same clean refusal (an empty
    file once answered INTERNAL: mmap refuses a length of 0 with a ValueError)."""
    try:
        if path.stat().st_size == 0:
            raise ConfigError(f"{what} is not a safetensors file: it is empty")
        map_weights(path)
    except codec.CodecError as exc:
        raise ConfigError(f"{what} is not a safetensors file: {str(exc)[:300]}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} is not a readable safetensors file: "
                          f"{str(exc)[:300]}") from None


def store(source: Path, job_dir: Path) -> None:
    """Move received/copied weights into the job's directory (same file system)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    os.replace(source, job_dir / STORED)


def load(job_dir: Path) -> dict[str, np.ndarray] | None:
    """The job's initial weights (read-only views of its file); None if it has none."""
    path = job_dir / STORED
    if not path.exists():
        return None
    try:
        return map_weights(path)
    except codec.CodecError as exc:
        raise ConfigError(f"the job's stored initial weights are damaged: {exc}") from None


def for_run(directory: Path, named: str | None, job_id: str) -> dict[str, np.ndarray] | None:
    """The initial weights a job starts from (None: a node builds the initial model), as its
    run reads them; `named`: the job's `initial_weights` key."""
    initial = load(directory)
    if initial is None and named is not None:
        if (directory / "state.json").exists():
            # Started by an earlier version, which kept a path: the checkpoint holds the
            # model now, and the path is not read (only a resume check would use it).
            log.info("job %s: initial_weights were a path on this host; resuming from "
                     "its checkpoint without them", job_id)
            return None
        raise ConfigError("initial_weights were not stored with this job (it was queued "
                          "by an earlier version, which kept a path): submit it again")
    return initial
