"""One task on the node: a training process of its own, watched and measured.

The round's process is forked by the worker factory (node/rounds/factory.py) when the agent has one,
else spawned fresh (`--no-prestart`, ring blocks, or a factory that is down). Either way the
agent never imports torch, so every CUDA context lives in the round's process and the driver
takes all of its memory back when that process exits. NVML used memory of the chosen GPU is
read before the worker starts (for a factory worker: as it starts, after any wait for a slot,
before it can have initialised CUDA), sampled while it runs (peak) and read after it exits.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedgpu.core.lifetime import child_env
from fedgpu.node.gpu_sampler import MemorySampler
from fedgpu.node.policy import Decision, subprocess_env
from fedgpu.node.rounds import workfiles
from fedgpu.node.rounds.factory_client import FactoryClient, FactoryUnavailable, FactoryWorker
from fedgpu.node.rounds.slots import Need

log = logging.getLogger("fedgpu.node.rounds.process")

# With a simulated NVML (the test suite's fake libnvidia-ml.so.1) every GPU decision and
# every NVML figure is real code against simulated hardware, but there is no CUDA device to
# train on: this switch keeps the whole GPU path and trains on the CPU. Never for production.
SIMULATED_GPUS_ENV = "FEDGPU_SIMULATED_GPUS"
SIMULATED_GPUS_WARNING = ("%s=1: GPU decisions and NVML accounting run against the NVML "
                          "library as loaded, training runs on the CPU (for testing the GPU "
                          "layer only)")
WORKER_MODULE = "fedgpu.node.rounds.worker"
# A round's process: spawned by the agent, or forked by the worker factory.
Worker = subprocess.Popen[bytes] | FactoryWorker
# RoundOutcome.error_kind of a round the aggregator no longer wanted (its worker was killed).
ABANDONED = "abandoned"
# How often the wait for a worker looks at the cancel event: the worker is gone this soon
# after the agent hears its task was abandoned.
_CANCEL_POLL_S = 0.25


def simulated_gpus() -> bool:
    return os.environ.get(SIMULATED_GPUS_ENV, "") == "1"


@dataclass
class RoundOutcome:
    ok: bool
    error: str = ""
    error_kind: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    weights: Path | None = None
    resources: dict[str, Any] = field(default_factory=dict)
    workdir: Path | None = None

    @property
    def abandoned(self) -> bool:
        return self.error_kind == ABANDONED

    def cleanup(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def run_task(
    *,
    kind: str,
    task_name: str,
    hyperparameters: dict[str, Any],
    seed: int,
    round_number: int,
    data_dir: Path,
    payload: bytes | bytearray | None,
    decision: Decision,
    work_root: Path | None,
    sampler: MemorySampler | None,
    torch_threads: int | None,
    timeout_s: float | None = None,
    worker_module: str = WORKER_MODULE,
    extra: dict[str, Any] | None = None,
    factory: FactoryClient | None = None,
    node_name: str = "",
    output: int | None = None,
    track: Callable[[Worker | None], None] | None = None,
    cancel: threading.Event | None = None,
) -> RoundOutcome:
    """Run one task in a process of its own. `output`: where that process writes its log (a
    file descriptor; None: where the agent writes); `track` is told the worker while it runs
    (so another thread can kill it when the agent stops); `cancel`, once set, kills it (the
    aggregator abandoned the task) and the outcome is ABANDONED."""
    started = time.monotonic()
    workdir: Path | None = None
    queued = 0.0
    try:
        workdir = Path(tempfile.mkdtemp(prefix=f"fedgpu-r{round_number}-", dir=work_root))
        task = task_file(kind, task_name, hyperparameters, seed, round_number, data_dir,
                          decision, torch_threads, extra)
        workfiles.write_json(workdir / workfiles.TASK_FILE, task)
        if payload is not None:
            (workdir / workfiles.WEIGHTS_IN).write_bytes(payload)
        # A worker that dies with the agent: no orphan keeps training, or holding the GPU.
        env = child_env(subprocess_env(decision, os.environ))
        uuid = decision.gpu_uuid if decision.device == "cuda" else None
        measure = uuid is not None and sampler is not None and sampler.active
        proc: Worker | None = None
        # Ring blocks always spawn their own worker (every rank must run at once: no slots).
        if factory is not None and worker_module == WORKER_MODULE:
            # The factory warms up installed tasks only: a bundle's code is imported by the
            # round's own worker and nowhere else.
            warm = None if (extra or {}).get("bundle") else {
                "task_name": task_name, "hyperparameters": hyperparameters,
                "data_dir": task["data_dir"]}
            proc = _from_factory(factory, workdir, env, decision, node_name, torch_threads,
                                 warm, output)
            queued = proc.queued_s if proc is not None else 0.0
        before = sampler.used_mib(uuid) if measure else None  # type: ignore[union-attr,arg-type]
        peak: int | None = None
        if proc is None:
            proc = subprocess.Popen([sys.executable, "-m", worker_module, str(workdir)], env=env,
                                    stdout=output, stderr=output)
    except FactoryUnavailable as exc:
        # Not a fallback case: the agent is stopping.
        return RoundOutcome(ok=False, error=str(exc), error_kind="stopped", workdir=workdir,
                            resources={"device": decision.device,
                                       "round_seconds": time.monotonic() - started})
    except OSError as exc:
        # No space for the files, no process to be had: this round fails, the agent goes on.
        log.error("cannot start round %d: %s", round_number, exc)
        return RoundOutcome(ok=False, error=f"cannot start the round: {exc}",
                            error_kind="start", workdir=workdir,
                            resources={"device": decision.device,
                                       "round_seconds": time.monotonic() - started})
    assert workdir is not None
    if track is not None:
        track(proc)
    try:
        if measure:
            with sampler.watch_peak(uuid, interval_s=0.05) as watch:  # type: ignore[union-attr,arg-type]
                code = wait_worker(proc, timeout_s, cancel)
            peak = watch.peak_mib
        else:
            code = wait_worker(proc, timeout_s, cancel)
    except BaseException:
        # Ctrl-C or a shutdown must not leave a training child holding the GPU.
        proc.kill()
        proc.wait()
        raise
    finally:
        if track is not None:
            track(None)
        if isinstance(proc, FactoryWorker):
            proc.close()
    after = (sampler.settled_mib_each({uuid: before})[uuid]  # type: ignore[union-attr,index]
             if measure else None)
    outcome = RoundOutcome(ok=False, workdir=workdir)
    outcome.resources = {
        "device": decision.device,
        "gpu_uuid": uuid or "",
        "nvml_used_before_mib": before,
        "nvml_used_peak_mib": peak,
        "nvml_used_after_mib": after,
        "round_seconds": time.monotonic() - started,
        "queued_seconds": queued,
    }
    if cancel is not None and cancel.is_set():
        outcome.error = "the aggregator no longer wants this task (its job was stopped or its "
        outcome.error += "round closed): its worker was killed"
        outcome.error_kind = ABANDONED
        return outcome
    lost = proc.lost if isinstance(proc, FactoryWorker) else None
    if lost:
        outcome.error, outcome.error_kind = lost, "crash"
        return outcome
    if code is None:
        outcome.error, outcome.error_kind = f"training subprocess exceeded {timeout_s}s", "timeout"
        return outcome
    if code != 0:
        err = read_json(workdir / workfiles.ERROR_FILE)
        outcome.error = (err or {}).get("error") or exit_reason(code)
        outcome.error_kind = (err or {}).get("kind") or "crash"
        return outcome
    result = read_json(workdir / workfiles.RESULT_FILE)
    if result is None:
        outcome.error, outcome.error_kind = "training subprocess wrote no result.json", "crash"
        return outcome
    return take_result(outcome, workdir, result)


def take_result(outcome: RoundOutcome, workdir: Path, result: dict[str, Any]) -> RoundOutcome:
    """A round whose worker (or rank 0 of several) wrote its result: the outcome carries it,
    the weights it wrote and its memory and time figures. Shared with ddp_launch.py."""
    outcome.ok = True
    outcome.result = result
    out = workdir / workfiles.WEIGHTS_OUT
    outcome.weights = out if out.exists() else None
    outcome.resources.update(
        torch_peak_allocated_mib=result.get("torch_peak_allocated_mib"),
        torch_peak_reserved_mib=result.get("torch_peak_reserved_mib"),
        rss_peak_mib=result.get("rss_peak_mib"),
        train_seconds=result.get("train_seconds", 0.0),
    )
    return outcome


def wait_worker(proc: Worker, timeout_s: float | None,
                cancel: threading.Event | None) -> int | None:
    """The worker's exit status; None when it ran past `timeout_s`. It is killed then, and as
    soon as `cancel` is set."""
    end = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = None if end is None else max(end - time.monotonic(), 0.001)
        step = left if cancel is None else min(left or _CANCEL_POLL_S, _CANCEL_POLL_S)
        try:
            return proc.wait(timeout=step)
        except subprocess.TimeoutExpired:
            if cancel is not None and cancel.is_set():
                proc.kill()
                return proc.wait()
            if end is not None and time.monotonic() >= end:
                proc.kill()
                proc.wait()
                return None


def _from_factory(factory: FactoryClient, workdir: Path, env: dict[str, str],
                  decision: Decision, node: str, torch_threads: int | None,
                  warm: dict[str, Any] | None, output: int | None) -> FactoryWorker | None:
    """The round's worker from the factory; None: spawn one instead (the factory is down)."""
    on_gpu = decision.device == "cuda" and decision.gpu_uuid is not None
    need = Need("cuda" if on_gpu else "cpu", decision.gpu_uuid if on_gpu else None,
                decision.memory_fraction if on_gpu else None)
    try:
        return factory.spawn(workdir=workdir, env=env, node=node, need=need,
                             torch_threads=torch_threads, warm=warm, output=output)
    except FactoryUnavailable as exc:
        if not exc.fallback:
            raise
        log.warning("%s; this round spawns a fresh worker instead", exc)
        return None


def task_file(kind: str, task_name: str, hyperparameters: dict[str, Any], seed: int,
               round_number: int, data_dir: Path, decision: Decision,
               torch_threads: int | None, extra: dict[str, Any] | None) -> workfiles.TaskFile:
    on_gpu = decision.device == "cuda" and not simulated_gpus()
    task: workfiles.TaskFile = {
        "kind": kind,  # type: ignore[typeddict-item]
        "task_name": task_name,
        "hyperparameters": hyperparameters,
        "seed": seed,
        "round": round_number,
        "data_dir": str(data_dir.resolve()),
        "device": "cuda:0" if on_gpu else "cpu",
        "memory_fraction": decision.memory_fraction if on_gpu else None,
        "torch_threads": torch_threads,
    }
    # Mode-specific sections (ring mode's rank and rendezvous) ride along for their worker.
    task.update(extra or {})  # type: ignore[typeddict-item]
    return task


def exit_reason(code: int) -> str:
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"training subprocess killed by signal {name}" + (
            " (out of host memory? the kernel OOM killer sends SIGKILL)" if -code == 9 else "")
    return f"training subprocess exited with code {code}"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


