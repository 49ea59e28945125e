"""Per-round process isolation: a round in a process of its own vs training in-process.

The digits task, CPU, one node's partition; the same round through three paths:
  spawned     fedgpu.node.rounds.process.run_task spawning python -m fedgpu.node.rounds.worker at
  the round
              (--no-prestart)
  factory     fedgpu.node.rounds.process.run_task with a worker factory (the agent's default): the
              round's process is forked from a process that imported torch, and warmed up on
              the task at the node's first (init) round, as the agent's factory does
  in-process  fedgpu.node.rounds.runner.run_round called directly, torch already imported and warm
    python -m benchmarks.isolation --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, emit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from fedgpu.core.datasets import split_digits
    from fedgpu.node import nvml, policy
    from fedgpu.node.rounds import workfiles
    from fedgpu.node.rounds.factory_client import FactoryClient
    from fedgpu.node.rounds.process import run_task

    hp = {"lr": 0.05, "local_epochs": 1}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        data = split_digits(tmp / "data", 3, "iid", 0.5, 0)[0]
        flags = policy.parse_gpu_flags("none", None, 0, None)
        decision = policy.decide(nvml.snapshot(), flags, job_use_gpu=False)

        def spawned(kind: str, payload: bytes | None, rnd: int,
                    factory: FactoryClient | None = None) -> tuple[float, bytes | None]:
            start = time.perf_counter()
            out = run_task(kind=kind, task_name="digits", hyperparameters=hp, seed=rnd,
                           round_number=rnd, data_dir=data, payload=payload,
                           decision=decision, work_root=tmp, sampler=None, torch_threads=1,
                           factory=factory)
            assert out.ok, out.error
            weights = out.weights.read_bytes() if out.weights else None
            out.cleanup()
            return time.perf_counter() - start, weights

        _, init = spawned("init", None, 0)
        spawn_s = [spawned("train", init, r)[0] for r in range(1, a.rounds + 1)]

        factory = FactoryClient.start_own()
        try:
            # The node's init round: the factory imports torch meanwhile and warms up on the
            # task before it forks that round's worker; every later worker inherits it.
            factory_init_s, _ = spawned("init", None, 0, factory)
            factory_s = [spawned("train", init, r, factory)[0] for r in range(1, a.rounds + 1)]
        finally:
            factory.close()

        import torch

        from fedgpu.node.rounds.runner import run_round
        from fedgpu.node.rounds.spec import parse_spec

        torch.set_num_threads(1)

        def in_process(rnd: int) -> float:
            start = time.perf_counter()
            work = Path(tempfile.mkdtemp(dir=tmp))
            task = {"kind": "train", "task_name": "digits", "hyperparameters": hp, "seed": rnd,
                    "round": rnd, "data_dir": str(data), "device": "cpu",
                    "memory_fraction": None, "torch_threads": 1}
            workfiles.write_json(work / workfiles.TASK_FILE, task)
            (work / workfiles.WEIGHTS_IN).write_bytes(init)  # type: ignore[arg-type]
            result = run_round(parse_spec(task), work)
            workfiles.write_json(work / workfiles.RESULT_FILE, result.to_dict())
            return time.perf_counter() - start

        in_process(0)  # warm: imports, allocator, dataset cache
        inproc_s = [in_process(r) for r in range(1, a.rounds + 1)]

    # What the spawn costs before any training: a Python start that imports torch.
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, cwd=ROOT)
    import_s = time.perf_counter() - start
    sp, ip = statistics.median(spawn_s), statistics.median(inproc_s)
    fp = statistics.median(factory_s)
    emit({"rounds": a.rounds, "spawned_round_s": round(sp, 3), "in_process_round_s": round(ip, 3),
          "overhead_s": round(sp - ip, 3), "python_plus_torch_import_s": round(import_s, 3),
          "factory_round_s": round(fp, 3), "factory_overhead_s": round(fp - ip, 3),
          "factory_init_round_s": round(factory_init_s, 3),
          "factory_all": [round(x, 3) for x in factory_s],
          "spawned_all": [round(x, 3) for x in spawn_s],
          "in_process_all": [round(x, 3) for x in inproc_s]})


if __name__ == "__main__":
    main()
