"""Per-round process isolation: a freshly spawned training process vs training in-process.

The digits task, CPU, one node's partition; the same round through three paths:
  spawned     fedgpu.node.round.run_task spawning python -m fedgpu.node.worker at the round
              (--no-prestart)
  pre-started fedgpu.node.round.run_task with a Standby (the agent's default): the round's
              process was started, imported torch and warmed up before the round, as the agent
              does while the previous round trains; here it is given time to get ready between
              rounds
  in-process  fedgpu.node.runner.run_round called directly, torch already imported and warm
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
    from fedgpu.node import nvml, policy, workfiles
    from fedgpu.node.round import Standby, run_task

    hp = {"lr": 0.05, "local_epochs": 1}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        data = split_digits(tmp / "data", 3, "iid", 0.5, 0)[0]
        flags = policy.parse_gpu_flags("none", None, 0, None)
        decision = policy.decide(nvml.snapshot(), flags, job_use_gpu=False)

        def spawned(kind: str, payload: bytes | None, rnd: int,
                    standby: Standby | None = None) -> tuple[float, bytes | None]:
            start = time.perf_counter()
            out = run_task(kind=kind, task_name="digits", hyperparameters=hp, seed=rnd,
                           round_number=rnd, data_dir=data, payload=payload,
                           decision=decision, work_root=tmp, sampler=None, torch_threads=1,
                           standby=standby)
            assert out.ok, out.error
            weights = out.weights.read_bytes() if out.weights else None
            out.cleanup()
            return time.perf_counter() - start, weights

        _, init = spawned("init", None, 0)
        spawn_s = [spawned("train", init, r)[0] for r in range(1, a.rounds + 1)]

        standby = Standby()
        prestart_s = []
        try:
            # As the agent does after the init round: the standby knows the task to warm up.
            standby.prepare({"task_name": "digits", "hyperparameters": hp,
                             "data_dir": str(data.resolve())})
            for r in range(1, a.rounds + 1):
                # The agent starts the standby while the previous round trains; between
                # rounds here, so the measurement is the round alone.
                time.sleep(6)
                prestart_s.append(spawned("train", init, r, standby)[0])
        finally:
            standby.close()

        import torch

        from fedgpu.node.runner import parse_spec, run_round

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
    pp = statistics.median(prestart_s)
    emit({"rounds": a.rounds, "spawned_round_s": round(sp, 3), "in_process_round_s": round(ip, 3),
          "overhead_s": round(sp - ip, 3), "python_plus_torch_import_s": round(import_s, 3),
          "prestarted_round_s": round(pp, 3), "prestarted_overhead_s": round(pp - ip, 3),
          "prestarted_all": [round(x, 3) for x in prestart_s],
          "spawned_all": [round(x, 3) for x in spawn_s],
          "in_process_all": [round(x, 3) for x in inproc_s]})


if __name__ == "__main__":
    main()
