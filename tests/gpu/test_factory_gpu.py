"""Round workers forked by the worker factory on a real GPU; skipped unless torch sees one.

What only a GPU can show: a worker forked from the factory initialises CUDA of its own (the
factory never does: no CUDA driver library in its memory map, no context on the card), trains
the round on the card, and once it exits the card's used memory is back where it was (0 MiB
left); two workers capped at 0.4 of the card train at once within the factory's GPU slots.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch

from fedgpu.core.datasets import split_digits
from fedgpu.node import nvml, policy
from fedgpu.node.gpu_sampler import MemorySampler
from fedgpu.node.rounds.factory_client import FactoryClient
from fedgpu.node.rounds.process import RoundOutcome, run_task

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device seen by torch"),
]
HP = {"lr": 0.05, "local_epochs": 2}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return split_digits(tmp_path_factory.mktemp("split"), 2, seed=3)


def _round(factory: FactoryClient, sampler: MemorySampler, decision: policy.Decision,
           kind: str, data: Path, work: Path, payload: bytes | None, node: str
           ) -> RoundOutcome:
    return run_task(kind=kind, task_name="digits", hyperparameters=HP, seed=1, round_number=1,
                    data_dir=data, payload=payload, decision=decision, work_root=work,
                    sampler=sampler, torch_threads=1, factory=factory, node_name=node)


def _gpu_pids(uuid: str) -> set[int]:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        return {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    finally:
        pynvml.nvmlShutdown()


def test_factory_workers_train_on_the_gpu_and_leave_nothing_behind(
        tmp_path: Path, nodes: list[Path], capfd: pytest.CaptureFixture[str]) -> None:
    snap = nvml.snapshot()
    decision = policy.decide(snap, policy.parse_gpu_flags("enforce", None, 2048, 0.4),
                             job_use_gpu=True)
    assert decision.device == "cuda" and decision.gpu_uuid
    factory = FactoryClient.start_own()
    try:
        with MemorySampler() as sampler:
            init = _round(factory, sampler, decision, "init", nodes[0], tmp_path, None, "a")
            assert init.ok, init.error
            assert init.weights is not None
            weights = init.weights.read_bytes()
            out = _round(factory, sampler, decision, "train", nodes[0], tmp_path, weights, "a")
            assert out.ok, out.error
            res = out.resources
            assert res["device"] == "cuda" and res["torch_peak_allocated_mib"] > 0
            assert res["nvml_used_peak_mib"] > res["nvml_used_before_mib"]
            # The worker exited with its round: everything it held is back.
            assert res["nvml_used_after_mib"] == res["nvml_used_before_mib"]
            logs = capfd.readouterr().err
            factory_pid = int(re.search(r"ready on \S+ \(pid (\d+)", logs).group(1))
            # The factory never initialised CUDA: no driver thread (torch 2.11's CUDA build maps
            # libcuda.so at import, uninitialised, which forks safely), no context on the card,
            # and the rounds were forked, not spawned.
            threads = [p.read_text().strip() for p in Path(f"/proc/{factory_pid}/task").glob(
                "*/comm")]
            assert threads == ["python3"] or len(threads) == 1, threads
            assert factory_pid not in _gpu_pids(decision.gpu_uuid)
            assert "not forking" not in logs
            assert "CUDA initialised before the task: no" in logs

            # Two nodes capped at 0.4 fit the card together: both train at once.
            results: list[RoundOutcome] = []

            def train(data: Path, name: str) -> None:
                results.append(_round(factory, sampler, decision, "train", data, tmp_path,
                                      weights, name))

            threads = [threading.Thread(target=train, args=(d, n))
                       for d, n in zip(nodes, ("a", "b"), strict=True)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            assert [r.ok for r in results] == [True, True], [r.error for r in results]
            assert all(r.resources["queued_seconds"] < 1 for r in results)
            for r in (init, out, *results):
                r.cleanup()
    finally:
        factory.close()
