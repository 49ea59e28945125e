"""The agent's side of a data-parallel round (`[resources] workers`): N worker processes, one
per device, started, watched and measured as one (node/rounds/ddp.py is their side).

Each rank is a freshly spawned `python -m fedgpu.node.rounds.worker` (never the worker factory:
every rank must run at once, so none may wait for a slot), bound to the agent's life like any
round's worker, with its own device in CUDA_VISIBLE_DEVICES (by GPU or MIG UUID) and its own
work directory (rank 0: the round's; rank r: `rank{r}/` inside it, sharing the weights in).
When one rank fails the others are killed at once (they would wait in a collective); the
round's result is rank 0's. Every device's NVML memory is read before, sampled for its peak
while the workers run, and read after they exit, as for a one-device round.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedgpu.core.lifetime import child_env
from fedgpu.node.gpu_sampler import MemorySampler
from fedgpu.node.policy import Decision, subprocess_env
from fedgpu.node.rounds import workfiles
from fedgpu.node.rounds.process import (
    ABANDONED,
    WORKER_MODULE,
    RoundOutcome,
    exit_reason,
    read_json,
    take_result,
    task_file,
    wait_worker,
)

# How often the group looks at its workers while none has exited.
_POLL_S = 0.05


class WorkerGroup:
    """The round's N worker processes as one worker: `wait` returns 0 when all exited 0, else
    the first failure's status (the others killed); `kill` ends them all."""

    def __init__(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        self.procs = list(procs)
        self.failed_rank: int | None = None

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in self.procs]
            bad = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if bad is not None:
                self.failed_rank = bad
                self.kill()
                for p in self.procs:
                    p.wait()
                return codes[bad]  # type: ignore[return-value]
            if all(c == 0 for c in codes):
                return 0
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired("data-parallel workers", timeout or 0)
            time.sleep(_POLL_S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_dir(workdir: Path, rank: int) -> Path:
    return workdir if rank == 0 else workdir / f"rank{rank}"


def run_workers(
    *,
    kind: str,
    task_name: str,
    hyperparameters: dict[str, Any],
    seed: int,
    round_number: int,
    data_dir: Path,
    payload: bytes | bytearray | None,
    decisions: Sequence[Decision],
    work_root: Path | None,
    sampler: MemorySampler | None,
    torch_threads: int | None,
    timeout_s: float | None = None,
    extra: dict[str, Any] | None = None,
    output: int | None = None,
    track: Callable[[Any], None] | None = None,
    cancel: threading.Event | None = None,
) -> RoundOutcome:
    """One round over `decisions` (one per rank, rank 0 first): a RoundOutcome like
    process.run_task's, with `devices` (each rank's device and memory) and `device_seconds`
    in its resources."""
    started = time.monotonic()
    world = len(decisions)
    if world < 1:
        # One is allowed: the benchmark measures the distributed path itself against the loop.
        raise ValueError("a data-parallel round needs at least one worker")
    workdir = Path(tempfile.mkdtemp(prefix=f"fedgpu-r{round_number}-", dir=work_root))
    init = f"tcp://127.0.0.1:{free_port()}"
    threads = torch_threads or max(1, (os.cpu_count() or 1) // world)
    uuids = [d.gpu_uuid if d.device == "cuda" else None for d in decisions]
    measured = [u for u in uuids if u]
    measure = bool(measured) and sampler is not None and sampler.active
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, decision in enumerate(decisions):
            rdir = rank_dir(workdir, rank)
            rdir.mkdir(exist_ok=True)
            task = task_file(kind, task_name, hyperparameters, seed, round_number, data_dir,
                              decision, threads, extra)
            task["ddp"] = {"rank": rank, "world_size": world,  # type: ignore[typeddict-unknown-key]
                           "init_method": init}
            workfiles.write_json(rdir / workfiles.TASK_FILE, task)
            if payload is not None:
                if rank == 0:
                    (rdir / workfiles.WEIGHTS_IN).write_bytes(payload)
                else:  # the same bytes, once on disk
                    os.link(workdir / workfiles.WEIGHTS_IN, rdir / workfiles.WEIGHTS_IN)
        before = sampler.used_mib_each(measured) if measure else {}  # type: ignore[union-attr]
        for rank, decision in enumerate(decisions):
            env = child_env(subprocess_env(decision, os.environ))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, str(rank_dir(workdir, rank))], env=env,
                stdout=output, stderr=output))
    except OSError as exc:
        for p in procs:
            p.kill()
            p.wait()
        return RoundOutcome(ok=False, error=f"cannot start the round's workers: {exc}",
                            error_kind="start", workdir=workdir,
                            resources={"device": decisions[0].device,
                                       "round_seconds": time.monotonic() - started})
    group = WorkerGroup(procs)
    if track is not None:
        track(group)
    peaks: dict[str, int | None] = {}
    try:
        if measure:
            with sampler.watch_peaks(measured, interval_s=0.05) as watch:  # type: ignore[union-attr]
                code = wait_worker(group, timeout_s, cancel)  # type: ignore[arg-type]
            peaks = dict(watch.peaks)
        else:
            code = wait_worker(group, timeout_s, cancel)  # type: ignore[arg-type]
    except BaseException:
        group.kill()
        for p in procs:
            p.wait()
        raise
    finally:
        if track is not None:
            track(None)
    after = sampler.settled_mib_each(before) if measure else {}  # type: ignore[union-attr]
    results = [read_json(rank_dir(workdir, r) / workfiles.RESULT_FILE) for r in range(world)]
    seconds = [float((res or {}).get("train_seconds") or 0.0) for res in results]
    devices = [{"rank": r, "device": d.device, "gpu_uuid": uuids[r] or "",
                "nvml_used_before_mib": before.get(uuids[r] or ""),
                "nvml_used_peak_mib": peaks.get(uuids[r] or ""),
                "nvml_used_after_mib": after.get(uuids[r] or ""),
                "train_seconds": seconds[r]} for r, d in enumerate(decisions)]
    first = devices[0]
    outcome = RoundOutcome(ok=False, workdir=workdir)
    outcome.resources = {
        "device": decisions[0].device, "gpu_uuid": uuids[0] or "",
        "nvml_used_before_mib": first["nvml_used_before_mib"],
        "nvml_used_peak_mib": first["nvml_used_peak_mib"],
        "nvml_used_after_mib": first["nvml_used_after_mib"],
        "round_seconds": time.monotonic() - started, "queued_seconds": 0.0,
        "devices": devices, "device_seconds": sum(seconds),
    }
    if cancel is not None and cancel.is_set():
        outcome.error = ("the aggregator no longer wants this task (its job was stopped or its "
                         "round closed): its workers were killed")
        outcome.error_kind = ABANDONED
        return outcome
    if code is None:
        outcome.error = f"data-parallel workers exceeded {timeout_s}s"
        outcome.error_kind = "timeout"
        return outcome
    if code != 0:
        rank = group.failed_rank or 0
        err = read_json(rank_dir(workdir, rank) / workfiles.ERROR_FILE) or {}
        outcome.error = f"worker rank {rank} of {world}: " + (
            err.get("error") or exit_reason(code))
        outcome.error_kind = err.get("kind") or "crash"
        return outcome
    result = results[0]
    if result is None:
        outcome.error, outcome.error_kind = "worker rank 0 wrote no result.json", "crash"
        return outcome
    return take_result(outcome, workdir, result)
