"""One task on the node: a freshly spawned training subprocess, watched and measured.

The agent never imports torch, so every CUDA context lives in the child and the driver
takes all of its memory back when the child exits. NVML used memory of the chosen GPU is read
before the child starts, sampled while it runs (peak) and read after it exits.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedgpu.core.lifetime import child_env
from fedgpu.node import workfiles
from fedgpu.node.gpu_sampler import MemorySampler
from fedgpu.node.policy import Decision, subprocess_env
from fedgpu.node.workfiles import ROUND_ENV_KEYS

log = logging.getLogger("fedgpu.node.round")

# With a simulated NVML (the test suite's fake libnvidia-ml.so.1) every GPU decision and
# every NVML figure is real code against simulated hardware, but there is no CUDA device to
# train on: this switch keeps the whole GPU path and trains on the CPU. Never for production.
SIMULATED_GPUS_ENV = "FEDGPU_SIMULATED_GPUS"


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

    def cleanup(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


class Standby:
    """The next round's training subprocess, started ahead of time.

    It imports torch and warms up while the agent waits for work, so a round no longer pays
    Python + torch start-up (seconds with a CUDA build). It never initialises CUDA before the
    round hands it the GPU decision, and it exits after that one round like a fresh worker, so
    all GPU memory is still returned when the round ends. Used only for `fedgpu.node.worker`.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def prepare(self, hint: dict[str, Any] | None = None) -> None:
        """Start the standby; `hint` (task name, hyperparameters, data dir) tunes its warm-up."""
        if self._proc is not None and self._proc.poll() is None:
            return
        # It dies with the agent (even a SIGKILLed one): the kernel signals it, and the pipe
        # it waits on closes.
        env = child_env({k: v for k, v in os.environ.items() if k not in ROUND_ENV_KEYS})
        cmd = [sys.executable, "-m", "fedgpu.node.worker", "--standby"]
        if hint:
            cmd.append(json.dumps(hint))
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)

    def take(self, workdir: Path, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """Hand the round to the waiting worker; None when there is none alive."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None or proc.stdin is None:
            return None
        msg = {"workdir": str(workdir), "env": {k: env.get(k) for k in ROUND_ENV_KEYS}}
        try:
            proc.stdin.write(json.dumps(msg).encode() + b"\n")
            proc.stdin.close()
        except OSError:
            proc.kill()
            proc.wait()
            return None
        return proc

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            # Closing stdin is the standby's signal to exit on its own; it holds nothing worth
            # waiting long for (the agent is stopping, maybe on a signal with a deadline).
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()


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
    worker_module: str = "fedgpu.node.worker",
    extra: dict[str, Any] | None = None,
    standby: Standby | None = None,
) -> RoundOutcome:
    started = time.monotonic()
    workdir: Path | None = None
    try:
        workdir = Path(tempfile.mkdtemp(prefix=f"fedgpu-r{round_number}-", dir=work_root))
        task = _task_file(kind, task_name, hyperparameters, seed, round_number, data_dir,
                          decision, torch_threads, extra)
        workfiles.write_json(workdir / workfiles.TASK_FILE, task)
        if payload is not None:
            (workdir / workfiles.WEIGHTS_IN).write_bytes(payload)
        # A worker that dies with the agent: no orphan keeps training, or holding the GPU.
        env = child_env(subprocess_env(decision, os.environ))
        uuid = decision.gpu_uuid if decision.device == "cuda" else None
        measure = uuid is not None and sampler is not None and sampler.active
        before = sampler.used_mib(uuid) if measure else None  # type: ignore[union-attr,arg-type]
        peak: int | None = None
        use_standby = standby is not None and worker_module == "fedgpu.node.worker"
        proc = standby.take(workdir, env) if use_standby else None  # type: ignore[union-attr]
        if proc is None:
            proc = subprocess.Popen([sys.executable, "-m", worker_module, str(workdir)], env=env)
    except OSError as exc:
        # No space for the files, no process to be had: this round fails, the agent goes on.
        log.error("cannot start round %d: %s", round_number, exc)
        return RoundOutcome(ok=False, error=f"cannot start the round: {exc}",
                            error_kind="start", workdir=workdir,
                            resources={"device": decision.device,
                                       "round_seconds": time.monotonic() - started})
    if use_standby:
        # The next round's worker loads torch while this one trains (on the GPU, usually), so
        # it is ready long before the next task arrives; it holds no GPU memory meanwhile.
        # Ring blocks always spawn their own worker: no standby to compete with the exchange.
        try:
            standby.prepare({"task_name": task_name,  # type: ignore[union-attr]
                             "hyperparameters": hyperparameters, "data_dir": task["data_dir"]})
        except OSError as exc:
            log.warning("cannot pre-start the next round's worker: %s", exc)
    assert workdir is not None
    try:
        if measure:
            with sampler.watch_peak(uuid, interval_s=0.05) as watch:  # type: ignore[union-attr,arg-type]
                code = proc.wait(timeout=timeout_s)
            peak = watch.peak_mib
        else:
            code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    except BaseException:
        # Ctrl-C or a shutdown must not leave a training child holding the GPU.
        proc.kill()
        proc.wait()
        raise
    after = sampler.used_mib(uuid) if measure else None  # type: ignore[union-attr,arg-type]
    outcome = RoundOutcome(ok=False, workdir=workdir)
    outcome.resources = {
        "device": decision.device,
        "gpu_uuid": uuid or "",
        "nvml_used_before_mib": before,
        "nvml_used_peak_mib": peak,
        "nvml_used_after_mib": after,
        "round_seconds": time.monotonic() - started,
    }
    if code is None:
        outcome.error, outcome.error_kind = f"training subprocess exceeded {timeout_s}s", "timeout"
        return outcome
    if code != 0:
        err = _read_json(workdir / workfiles.ERROR_FILE)
        outcome.error = (err or {}).get("error") or _exit_reason(code)
        outcome.error_kind = (err or {}).get("kind") or "crash"
        return outcome
    result = _read_json(workdir / workfiles.RESULT_FILE)
    if result is None:
        outcome.error, outcome.error_kind = "training subprocess wrote no result.json", "crash"
        return outcome
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


def _task_file(kind: str, task_name: str, hyperparameters: dict[str, Any], seed: int,
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


def _exit_reason(code: int) -> str:
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"training subprocess killed by signal {name}" + (
            " (out of host memory? the kernel OOM killer sends SIGKILL)" if -code == 9 else "")
    return f"training subprocess exited with code {code}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


