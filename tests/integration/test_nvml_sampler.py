"""NVML's one owner (node/nvml.py) and the memory sampler the agent polls during a round,
through the real pynvml against the fake libnvidia-ml.so.1 (tests/fake_nvml/fake_nvml.c).

Each case runs in a subprocess: pynvml keeps the first NVML library it loads for the life of
the process. The host states, the GPU policy and `fedgpu devices` are in test_nvml_fake.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from tests.fixtures.fake_nvml import FakeNvml, fake_uuid
from tests.integration.test_nvml_fake import _fleet

# --- the sampler the agent polls during a round ----------------------------------------------

SAMPLER = textwrap.dedent(
    """
    import sys
    from fedgpu.node.gpu_sampler import MemorySampler
    uuid = sys.argv[1]
    with MemorySampler() as sampler:
        for line in sys.stdin:
            if line.strip() == "peak":
                with sampler.watch_peak(uuid, interval_s=0.005) as watch:
                    print("watching", flush=True)
                    sys.stdin.readline()
                print("peak", watch.peak_mib, watch.samples > 1, flush=True)
            else:
                print(sampler.used_mib(uuid), flush=True)
    """
)


def test_memory_sampler_follows_changes_and_survives_a_lost_gpu(fake_nvml: FakeNvml) -> None:
    fleet = _fleet(2)
    fake_nvml.write(fleet)
    proc = subprocess.Popen(
        [sys.executable, "-c", SAMPLER, fake_uuid(1)],
        env=fake_nvml.env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin and proc.stdout

    def ask(line: str = "sample") -> str:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    try:
        assert ask() == "2000"
        fleet[1]["memory_used_mib"] = 30000
        fake_nvml.write(fleet)
        assert ask() == "30000"
        assert ask("peak") == "watching"
        fleet[1]["memory_used_mib"] = 70000
        fake_nvml.write(fleet)
        time.sleep(0.3)
        fleet[1]["memory_used_mib"] = 5000
        fake_nvml.write(fleet)
        time.sleep(0.1)
        assert ask("stop") == "peak 70000 True"
        fleet[1]["lost"] = True
        fake_nvml.write(fleet)
        assert ask() == "None"
        del fleet[1]["lost"]
        fake_nvml.write(fleet)
        assert ask() == "5000"  # the GPU came back: the handle is looked up again
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
    assert proc.returncode == 0, proc.stderr.read()


def test_nvml_has_one_owner_the_sampler_and_snapshots_share_it(fake_nvml: FakeNvml) -> None:
    # node/nvml.py initialises NVML for its first user and shuts it down after the last:
    # snapshots taken while the agent's sampler holds it cost no nvmlInit of their own, and
    # the sampler's samples go on working across them.
    fake_nvml.write(_fleet(2))
    out = fake_nvml.python(
        "import pynvml, fedgpu.node.nvml as n\n"
        "from fedgpu.node.gpu_sampler import MemorySampler\n"
        f"uuid = {fake_uuid(1)!r}\n"
        "calls = []\n"
        "for name in ('nvmlInit', 'nvmlShutdown'):\n"
        "    real = getattr(pynvml, name)\n"
        "    def counted(*a, _real=real, _name=name):\n"
        "        calls.append(_name)\n"
        "        return _real(*a)\n"
        "    setattr(pynvml, name, counted)\n"
        "with MemorySampler() as s:\n"
        "    before = s.used_mib(uuid)\n"
        "    gpus = [len(n.snapshot().gpus) for _ in range(3)]\n"
        "    after = s.used_mib(uuid)\n"
        "print(calls, gpus, before, after)\n"
        "try:\n    pynvml.nvmlDeviceGetCount()\n"
        "except pynvml.NVMLError_Uninitialized:\n    print('shut down')\n"
        "print(n.snapshot().available, calls[2:])\n"
    )
    assert out.splitlines() == [
        "['nvmlInit', 'nvmlShutdown'] [2, 2, 2] 2000 2000",
        "shut down",
        "True ['nvmlInit', 'nvmlShutdown']",
    ]


def test_memory_sampler_without_nvml_answers_none(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_fleet(1), init_error="no_permission")
    out = fake_nvml.python(
        "from fedgpu.node.gpu_sampler import MemorySampler\n"
        "with MemorySampler() as s:\n"
        f"    print(s.active, s.used_mib({fake_uuid(0)!r}), s.reason)\n"
    )
    assert out.startswith("False None no permission")


SETTLE = textwrap.dedent(
    """
    import sys, time
    from fedgpu.node.gpu_sampler import MemorySampler
    uuid = sys.argv[1]
    with MemorySampler() as sampler:
        print("ready", flush=True)
        t = time.monotonic()
        got = sampler.settled_mib_each({uuid: 2000}, within_s=float(sys.argv[2]))
        print(got[uuid], round(time.monotonic() - t, 2), flush=True)
    """
)


def test_a_rounds_after_reading_waits_for_the_driver_to_free_the_memory(
        fake_nvml: FakeNvml) -> None:
    # An exited worker's memory is freed by the driver a moment after the process is reaped
    # (seen on an H200: 849 MiB at once, the baseline a few ms later): "after" waits for the
    # baseline, within a bound, instead of reporting a residue that was never there.
    fleet = _fleet(2)
    fleet[1]["memory_used_mib"] = 2849
    fake_nvml.write(fleet)

    def settle(within_s: float, free_after_s: float | None) -> tuple[int, float]:
        proc = subprocess.Popen([sys.executable, "-c", SETTLE, fake_uuid(1), str(within_s)],
                                env=fake_nvml.env(), stdout=subprocess.PIPE, text=True)
        assert proc.stdout and proc.stdout.readline().strip() == "ready"
        if free_after_s is not None:
            time.sleep(free_after_s)
            fleet[1]["memory_used_mib"] = 2000
            fake_nvml.write(fleet)
        value, took = proc.stdout.readline().split()
        proc.wait(timeout=10)
        return int(value), float(took)

    value, took = settle(within_s=10.0, free_after_s=0.4)
    assert value == 2000 and 0.3 <= took < 5.0
    fleet[1]["memory_used_mib"] = 2849  # a residue that stays: reported, after the bound
    fake_nvml.write(fleet)
    value, took = settle(within_s=0.5, free_after_s=None)
    assert value == 2849 and took >= 0.5
