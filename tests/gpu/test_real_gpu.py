"""The NVML layer and the GPU policy against a real driver, cross-checked with nvidia-smi and CUDA.

Skipped where nvidia-smi or a real NVML is missing. The CUDA checks also need a CUDA
build of torch; they run torch only in subprocesses, as the agent does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from fedgpu.node import gpu_sampler, nvml
from fedgpu.node.policy import decide, parse_gpu_flags, subprocess_env

pytestmark = pytest.mark.gpu

QUERY = "index,uuid,name,memory.total,memory.used"


def _smi_rows() -> list[list[str]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi not found: no NVIDIA driver here")
    done = subprocess.run(
        [smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        pytest.skip(f"nvidia-smi failed: {done.stderr.strip() or done.stdout.strip()}")
    return [[f.strip() for f in line.split(",")] for line in done.stdout.splitlines() if line]


def _host() -> nvml.NvmlSnapshot:
    _smi_rows()
    snap = nvml.snapshot(env={})  # the whole host, as nvidia-smi shows it
    if not snap.available:
        pytest.skip(f"real NVML unavailable: {snap.reason}")
    return snap


def _torch_cuda(env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def _require_cuda_torch() -> None:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    done = _torch_cuda(dict(os.environ), probe)
    if done.returncode != 0:
        pytest.skip(f"no CUDA build of torch here: {done.stderr.strip()[-200:] or 'cpu only'}")


def test_snapshot_matches_nvidia_smi() -> None:
    rows = _smi_rows()
    snap = _host()
    assert snap.driver_version and snap.cuda_driver_version
    assert len(snap.gpus) == len(rows)
    for g, (index, uuid, name, total, used) in zip(snap.gpus, rows, strict=True):
        assert g.healthy, g.reason
        assert (g.index, g.uuid, g.name) == (int(index), uuid, name)
        assert g.memory_total_mib == int(total)
        assert g.memory_used_mib is not None and g.memory_free_mib is not None
        # Other processes may allocate between the two reads; allow some drift.
        assert abs(g.memory_used_mib - int(used)) <= max(256, int(total) // 50)
        assert g.memory_used_mib + g.memory_free_mib <= g.memory_total_mib


@pytest.mark.parametrize("fraction", [None, 0.5])
def test_training_subprocess_sees_exactly_the_chosen_gpu_as_cuda0(fraction: float | None) -> None:
    snap = _host()
    _require_cuda_torch()
    code = textwrap.dedent(
        """
        import os, torch
        p = torch.cuda.get_device_properties(0)
        fraction = os.environ.get("FEDGPU_MEMORY_FRACTION")
        if fraction:
            torch.cuda.set_per_process_memory_fraction(float(fraction), 0)
        torch.ones(1, device=os.environ["FEDGPU_DEVICE"])
        print(torch.cuda.device_count(), "GPU-" + str(p.uuid), fraction)
        """
    )
    for g in snap.gpus:
        if not g.healthy:
            continue
        flags = parse_gpu_flags("enforce", g.uuid, 0, fraction)
        decision = decide(snap, flags, job_use_gpu=True)
        assert decision.gpu_uuid == g.uuid
        done = _torch_cuda(subprocess_env(decision, dict(os.environ)), code)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["1", g.uuid, str(fraction) if fraction else "None"]


def test_cpu_decision_hides_every_gpu_from_cuda() -> None:
    snap = _host()
    _require_cuda_torch()
    decision = decide(snap, parse_gpu_flags("none", None, 0, None), job_use_gpu=True)
    code = "import torch; print(torch.cuda.device_count())"
    done = _torch_cuda(subprocess_env(decision, dict(os.environ)), code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


def test_memory_sampler_sees_a_subprocess_allocate_and_release() -> None:
    snap = _host()
    _require_cuda_torch()
    decision = decide(snap, parse_gpu_flags("enforce", None, 2048, None), job_use_gpu=True)
    assert decision.gpu_uuid is not None
    code = textwrap.dedent(
        """
        import sys, torch
        x = torch.empty(1024 * 1024 * 1024, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        print("allocated", flush=True)
        sys.stdin.readline()
        """
    )
    with gpu_sampler.MemorySampler() as sampler:
        before = sampler.used_mib(decision.gpu_uuid)
        assert before is not None, sampler.reason
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            env=subprocess_env(decision, dict(os.environ)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdin and proc.stdout
        try:
            with sampler.watch_peak(decision.gpu_uuid, interval_s=0.02) as watch:
                assert proc.stdout.readline().strip() == "allocated"
                during = sampler.used_mib(decision.gpu_uuid)
                proc.stdin.write("\n")
                proc.stdin.flush()
                proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        # NVML may report the released memory a moment late.
        deadline = time.monotonic() + 10
        after = sampler.used_mib(decision.gpu_uuid)
        while after is not None and after > before + 256 and time.monotonic() < deadline:
            time.sleep(0.1)
            after = sampler.used_mib(decision.gpu_uuid)
    assert during is not None and during >= before + 1024
    assert watch.peak_mib is not None and watch.peak_mib >= during
    assert after is not None and after <= before + 256
