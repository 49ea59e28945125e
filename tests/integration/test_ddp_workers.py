"""Data-parallel rounds (`[resources] workers`) through real worker processes: two gloo
workers on the CPU train the same model as one worker from the same seed and global batch
(digits: a tensor task; images: a Dataset task with BatchNorm; causal-lm: LoRA adapters), rank
0's update is the site's, each device's memory is measured (fake NVML), and a rank that fails
takes the round down with its reason."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.core.datasets import split_digits
from fedgpu.core.synth_images import synth_images
from fedgpu.node import nvml, policy
from fedgpu.node.rounds import runner
from fedgpu.node.rounds.ddp_launch import run_workers
from fedgpu.node.rounds.process import RoundOutcome
from fedgpu.node.rounds.workfiles import WEIGHTS_IN, WEIGHTS_OUT
from tests.fixtures.fake_nvml import FakeNvml, fake_mig_uuid, fake_uuid


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    # Two workers and the one-worker baseline share a small CI machine.
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = old


def _cpu() -> policy.Decision:
    return policy.decide(nvml.snapshot(), policy.parse_gpu_flags("none", None, 0, None),
                         job_use_gpu=False)


def _init(tmp: Path, task: str, data_dir: Path, hp: dict[str, Any]) -> bytes:
    work = tmp / f"init-{task}"
    work.mkdir()
    spec = runner.parse_spec({"kind": "init", "task_name": task, "hyperparameters": hp,
                              "seed": 0, "round": 1, "data_dir": str(data_dir),
                              "device": "cpu", "torch_threads": 1})
    runner.run_round(spec, work)
    return (work / WEIGHTS_OUT).read_bytes()


def _one(tmp: Path, task: str, data_dir: Path, hp: dict[str, Any], payload: bytes
         ) -> RoundOutcome:
    """The one-worker baseline, in this process (the runner's own path, no DDP)."""
    work = tmp / f"one-{task}"
    work.mkdir()
    (work / WEIGHTS_IN).write_bytes(payload)
    spec = runner.parse_spec({"kind": "train", "task_name": task, "hyperparameters": hp,
                              "seed": 5, "round": 1, "data_dir": str(data_dir),
                              "device": "cpu", "torch_threads": 1})
    result = runner.run_round(spec, work).to_dict()
    return RoundOutcome(ok=True, result=result, weights=work / WEIGHTS_OUT, workdir=work)


def _two(tmp: Path, task: str, data_dir: Path, hp: dict[str, Any], payload: bytes
         ) -> RoundOutcome:
    out = run_workers(kind="train", task_name=task, hyperparameters=hp, seed=5,
                      round_number=1, data_dir=data_dir, payload=payload,
                      decisions=(_cpu(), _cpu()), work_root=tmp, sampler=None,
                      torch_threads=1, timeout_s=240)
    assert out.ok, out.error
    return out


def _same_model(one: RoundOutcome, two: RoundOutcome, atol: float) -> None:
    assert one.weights is not None and two.weights is not None
    a, b = codec.read_file(one.weights), codec.read_file(two.weights)
    assert a.keys() == b.keys()
    start = codec.read_file(one.workdir / WEIGHTS_IN)  # type: ignore[operator]
    moved = 0.0
    for name in a:
        np.testing.assert_allclose(b[name], a[name], atol=atol, rtol=1e-3, err_msg=name)
        moved = max(moved, float(np.abs(a[name].astype(np.float64) - start[name]).max()))
    assert moved > 10 * atol  # training changed the model: the comparison means something


def _check_site_figures(one: RoundOutcome, two: RoundOutcome) -> None:
    # num_examples is the site's whole training set, every rank's share of it.
    assert two.result["num_examples"] == one.result["num_examples"]
    assert two.result["train_metrics"]["examples"] == one.result["train_metrics"]["examples"]
    assert two.result["train_metrics"]["loss"] == pytest.approx(
        one.result["train_metrics"]["loss"], rel=1e-3)
    assert two.result["eval_metrics"] == pytest.approx(one.result["eval_metrics"], rel=1e-4)
    devices = two.resources["devices"]
    assert [d["rank"] for d in devices] == [0, 1] and {d["device"] for d in devices} == {"cpu"}
    assert all(d["train_seconds"] > 0 for d in devices)
    assert two.resources["device_seconds"] == pytest.approx(
        sum(d["train_seconds"] for d in devices))


@pytest.mark.timeout(300)
def test_digits_two_workers_train_the_model_one_worker_trains(tmp_path: Path) -> None:
    data = split_digits(tmp_path / "split", 8, seed=3)[0]  # ~180 examples: 5 global batches
    hp = {"local_epochs": 1, "batch_size": 32}
    payload = _init(tmp_path, "digits", data, hp)
    one, two = _one(tmp_path, "digits", data, hp, payload), _two(tmp_path, "digits", data, hp,
                                                                 payload)
    _same_model(one, two, atol=1e-4)
    _check_site_figures(one, two)


@pytest.mark.timeout(300)
def test_images_two_workers_match_one_with_batchnorm_over_the_global_batch(
        tmp_path: Path) -> None:
    data = synth_images(tmp_path / "img", 1, classes=4, per_class=12, size=16)[0]
    hp = {"depth": 8, "width": 4, "image_size": 16, "batch_size": 8, "num_workers": 0,
          "augment": False}
    payload = _init(tmp_path, "images", data, hp)
    one, two = _one(tmp_path, "images", data, hp, payload), _two(tmp_path, "images", data, hp,
                                                                 payload)
    _same_model(one, two, atol=2e-4)
    _check_site_figures(one, two)


@pytest.mark.timeout(300)
def test_causal_lm_two_workers_match_one(tmp_path: Path, lm_data: Path) -> None:
    hp = {"model_dir": str(lm_data / "model"), "lr": 0.003, "batch_size": 8, "seq_len": 32,
          "max_steps": 3, "lora_dropout": 0.0, "target_modules": "q_proj,v_proj", "lora_r": 4}
    data = lm_data / "node-1"
    payload = _init(tmp_path, "causal-lm", data, hp)
    one = _one(tmp_path, "causal-lm", data, hp, payload)
    two = _two(tmp_path, "causal-lm", data, hp, payload)
    _same_model(one, two, atol=1e-4)
    assert two.result["num_examples"] == one.result["num_examples"]


@pytest.mark.timeout(240)
def test_a_rank_whose_process_teardown_aborts_still_hands_in_the_round(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's interpreter teardown can abort after its result is written (gloo's threads
    still holding tensors: SIGABRT, seen in CI): what the ranks wrote is the round, not how
    their interpreters would have torn down. Here every worker process registers an exit hook
    that aborts (a sitecustomize on the PYTHONPATH the workers inherit)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import atexit, os\natexit.register(os.abort)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]))
    data = split_digits(tmp_path / "split", 8, seed=3)[0]
    payload = _init(tmp_path, "digits", data, {})
    out = run_workers(kind="train", task_name="digits", hyperparameters={},
                      seed=5, round_number=1, data_dir=data, payload=payload,
                      decisions=(_cpu(), _cpu()), work_root=tmp_path, sampler=None,
                      torch_threads=1, timeout_s=200)
    assert out.ok, out.error
    assert out.weights is not None and out.weights.stat().st_size > 0
    assert out.result["num_examples"] > 0


A100 = {"name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960, "memory_used_mib": 30000}
H100_MIG = {"name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559,
            "compute_capability": "9.0", "mig_mode": True, "mig": [
                {"name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "memory_total_mib": 40448,
                 "memory_used_mib": 448, "gpu_instance_id": 2, "compute_instance_id": 0}]}
ON_FAKE_GPUS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from fedgpu.core.job import Resources
    from fedgpu.node import nvml, policy
    from fedgpu.node.gpu_sampler import MemorySampler
    from fedgpu.node.rounds.ddp_launch import run_workers
    from fedgpu.node.worker_devices import decisions_for
    snap = nvml.snapshot()
    flags = policy.parse_gpu_flags("enforce", None, 1000, None)
    need = Resources(workers=2)
    decisions = decisions_for(snap, flags, need, policy.decide_for_job(snap, flags, need))
    with MemorySampler() as sampler:
        out = run_workers(kind="train", task_name="digits", hyperparameters={"lr": -1.0},
                          seed=5, round_number=1, data_dir=Path(sys.argv[1]), payload=None,
                          decisions=decisions, work_root=Path(sys.argv[2]), sampler=sampler,
                          torch_threads=1, timeout_s=120)
    print(json.dumps({"ok": out.ok, "kind": out.error_kind, "error": out.error,
                      "resources": out.resources}))
""")


@pytest.mark.timeout(240)
def test_each_device_is_measured_and_a_failing_rank_fails_the_round_with_its_reason(
        tmp_path: Path, fake_nvml: FakeNvml) -> None:
    """Two devices by policy (a MIG device and a whole GPU of the fake NVML; training runs on
    the CPU with simulated GPUs): each one's memory is read before, during and after, and a
    rank's bad input ends the round, named by its rank."""
    fake_nvml.write([A100, H100_MIG])
    data = split_digits(tmp_path / "split", 8, seed=3)[0]
    env = fake_nvml.env({"FEDGPU_SIMULATED_GPUS": "1", "OMP_NUM_THREADS": "1"})
    done = fake_nvml.run(["-c", ON_FAKE_GPUS, str(data), str(tmp_path)], env, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert not out["ok"] and out["kind"] == "bad_input"
    assert out["error"].startswith("worker rank ") and "lr" in out["error"]
    devices = out["resources"]["devices"]
    # By free memory: the MIG device (40000 MiB free) first, then the A100 (10960).
    assert [d["gpu_uuid"] for d in devices] == [fake_mig_uuid(1, 0), fake_uuid(0)]
    assert [(d["nvml_used_before_mib"], d["nvml_used_peak_mib"], d["nvml_used_after_mib"])
            for d in devices] == [(448, 448, 448), (30000, 30000, 30000)]
