"""Helpers shared by the benchmarks: memory figures, subprocess cases, synthetic models.

Only numpy and the standard library: Flower's side runs these too, in its own venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
# Flower pins protobuf < 7 and older typer; fedgpu's generated code needs protobuf 7, so
# Flower lives in its own venv and its side of each comparison runs there as a subprocess.
BENCH_VENV = ROOT / ".venv-bench"


def bench_python() -> str:
    return str(BENCH_VENV / "bin" / "python")


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def peak_rss_mib() -> float:
    return _status_kib("VmHWM") / 1024


def _status_kib(key: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def proc_rss_mib(pid: int) -> tuple[float, float]:
    """(current, peak) resident memory of another process."""
    return _status_kib("VmRSS", pid) / 1024, _status_kib("VmHWM", pid) / 1024


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def model_arrays(params: int, tensors: int, seed: int) -> list[np.ndarray]:
    """`tensors` float32 arrays totalling `params`, in the same layout on both sides."""
    rng = np.random.default_rng(seed)
    each = params // tensors
    sizes = [each] * (tensors - 1) + [params - each * (tensors - 1)]
    return [rng.standard_normal(n, dtype=np.float32) for n in sizes]


def run_case(module: str, args: list[str], python: str | None = None,
             timeout: float = 600) -> dict[str, Any]:
    """Run one measurement in a fresh process (clean peak RSS) and return its JSON line."""
    cmd = [python or sys.executable, "-m", module, *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def emit(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


FEDGPU = [sys.executable, "-m", "fedgpu.cli.app"]
TOKEN = "bench-token"
# The aggregator's operator token (it must differ from the nodes'): what query() asks with.
OPERATOR_TOKEN = "bench-operator-token"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), FEDGPU_TOKEN=TOKEN, PYTHONUNBUFFERED="1",
               FEDGPU_OPERATOR_TOKEN=OPERATOR_TOKEN)
    return subprocess.Popen([*FEDGPU, *args], cwd=ROOT, env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115


def write_job(path: Path, **job: Any) -> Path:
    lines = [f"{k} = {json.dumps(v)}" for k, v in job.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def start_aggregator(job: Path, log: Path, *extra: str, tls: Any = None
                     ) -> tuple[subprocess.Popen[bytes], str]:
    from fedgpu.core import admin_client
    from fedgpu.core.errors import FedgpuError

    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = spawn(["server", "start", "--job", str(job), "--host", "127.0.0.1", "--port",
                  str(port), "--log-level", "WARNING", *extra], log)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"aggregator exited: {log.read_text()[-2000:]}")
        try:
            if admin_client.health(address, timeout=1, tls=tls) == "SERVING":
                return proc, address
        except FedgpuError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("aggregator never became healthy")


def query(address: str, method: str) -> dict[str, Any]:
    from fedgpu.core import admin_client

    return admin_client.query(address, OPERATOR_TOKEN, method)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
