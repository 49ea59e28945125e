"""causal-lm end to end: the tutorial's commands as written (a 3-site federation of real
processes on the CPU), and a round's state (what the wire carries) holding adapters only."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("peft")

from fedgpu.core import codec  # noqa: E402
from fedgpu.node import weights  # noqa: E402
from fedgpu.node.rounds import runner  # noqa: E402
from fedgpu.node.rounds.workfiles import WEIGHTS_IN, WEIGHTS_OUT  # noqa: E402
from fedgpu.node.tasks.causal_lm.memory import read_header  # noqa: E402
from tests.fixtures.federation import ROOT, base_env  # noqa: E402

TUTORIAL = ROOT / "docs" / "tutorials" / "fine-tune-a-language-model.md"
PEFT_PREFIX = "base_model.model."


def _steps(md: str) -> list[tuple[str, str]]:
    """("sh", command) for each `$ ` line of a console block, ("py", source) for each python
    block, in the order the page gives them."""
    steps = []
    for lang, body in re.findall(r"```(console|python)\n(.*?)```", md, flags=re.S):
        if lang == "python":
            steps.append(("py", body))
        else:
            steps += [("sh", line[2:]) for line in body.splitlines() if line.startswith("$ ")]
    return steps


def _base_names(model_dir: Path) -> set[str]:
    return {t.name for t in read_header(model_dir / "model.safetensors")}


def _check_adapters_only(arrays: dict[str, np.ndarray], base: set[str]) -> None:
    assert arrays and all(".lora_A." in n or ".lora_B." in n for n in arrays), sorted(arrays)[:5]
    # Not one base tensor, under its own name or peft's.
    assert not {n.removeprefix(PEFT_PREFIX) for n in arrays} & base
    assert not set(arrays) & base


@pytest.mark.timeout(900)
def test_tutorial_commands_run_as_written_and_perplexity_falls(tmp_path: Path) -> None:
    # The tutorial runs in a checkout's top directory: examples/ is there.
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = base_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   HF_HUB_OFFLINE="1")
    outputs = []
    steps = _steps(TUTORIAL.read_text())
    assert [k for k, _ in steps].count("sh") >= 4 and ("py" in {k for k, _ in steps})
    for kind, text in steps:
        if kind == "py":
            (tmp_path / "generate.py").write_text(text)
            cmd = [sys.executable, "generate.py"]
        else:
            cmd = ["bash", "-c", text]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"{text}\n{r.stdout}\n{r.stderr}"
        outputs.append(r.stdout)

    model_dir = tmp_path / "lm-data" / "model"
    base = _base_names(model_dir)
    base_bytes = (model_dir / "model.safetensors").stat().st_size
    for run in ("lm-run", "lm-run-ffa"):
        doc = json.loads((tmp_path / run / "rounds.json").read_text())
        ppl = [math.exp(doc["initial_eval"]["loss"])] + [
            math.exp(r["eval"]["loss"]) for r in doc["rounds"]]
        assert all(a > b for a, b in zip(ppl, ppl[1:], strict=False)), (run, ppl)
        assert ppl[0] > 50 and ppl[-1] < 4, (run, ppl)
        for r in doc["rounds"]:
            for u in r["updates"]:
                assert u["eval_metrics"]["perplexity"] == pytest.approx(
                    math.exp(u["eval_metrics"]["loss"]), rel=1e-6)
        checkpoints = sorted((tmp_path / run / "state" / "jobs").glob("*/global*.safetensors"))
        assert checkpoints
        for path in checkpoints:
            arrays = codec.read_file(path)
            _check_adapters_only(arrays, base)
        payload = checkpoints[-1].stat().st_size
        # On the wire: each update the aggregator took is one adapter payload, not the model.
        for r in doc["rounds"]:
            per_update = r["bytes_received"] / r["nodes_reporting"]
            assert per_update == pytest.approx(payload, rel=0.05), (per_update, payload)
            assert per_update < base_bytes / 4
    assert "perplexity" in outputs[1] and "final global model" in outputs[1]
    # The listing step names adapter tensors only.
    listed = [line for out in outputs for line in out.splitlines() if "lora_" in line]
    assert len(listed) >= 3
    # generate.py continues w0 with the rule the sites' text follows (5i + 3 mod 48), mostly.
    generated = next(o for o in outputs if o.startswith("w0")).split()
    ids = [int(w[1:]) for w in generated]
    follows = sum(b == (5 * a + 3) % 48 for a, b in zip(ids, ids[1:], strict=False))
    assert follows >= 6, generated


def _round(lm_data: Path, workdir: Path, kind: str, hp: dict, global_model: dict | None,
           seed: int = 0) -> tuple[runner.RoundResult, dict[str, np.ndarray] | None]:
    workdir.mkdir(parents=True)
    if global_model is not None:
        weights.write_weights(workdir / WEIGHTS_IN, global_model)
    spec = runner.parse_spec({
        "kind": kind, "task_name": "causal-lm", "seed": seed, "round": 1,
        "hyperparameters": {"model_dir": str(lm_data / "model"), **hp},
        "data_dir": str(lm_data / "node-1"), "device": "cpu", "torch_threads": 1,
    })
    result = runner.run_round(spec, workdir)
    out = workdir / WEIGHTS_OUT
    return result, (codec.read_file(out) if out.exists() else None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("freeze_a", [False, True])
def test_a_round_sends_and_takes_adapters_only(lm_data: Path, tmp_path: Path,
                                               freeze_a: bool) -> None:
    hp = {"lr": 0.003, "batch_size": 16, "seq_len": 32, "max_steps": 4,
          "freeze_lora_a": freeze_a, "target_modules": "q_proj,v_proj", "lora_r": 4}
    _, init = _round(lm_data, tmp_path / "init", "init", hp, None)
    assert init is not None
    _check_adapters_only(init, _base_names(lm_data / "model"))
    # q_proj and v_proj of 2 layers, A [4, 64] and B [64, 4] each: 2 * 2 * 2 = 8 tensors.
    assert len(init) == 8 and {a.shape for a in init.values()} == {(4, 64), (64, 4)}
    assert all(a.dtype == np.float32 for a in init.values())
    result, trained = _round(lm_data, tmp_path / "train", "train", hp, init, seed=1)
    assert trained is not None and trained.keys() == init.keys()
    assert result.eval_metrics["perplexity"] > result.train_metrics["loss"]
    for name in init:
        changed = not np.array_equal(init[name], trained[name])
        # B starts at zero and always trains; A only without FFA-LoRA.
        assert changed == (".lora_B." in name or not freeze_a), name
    # A base model of another shape is refused by name, not loaded half-way.
    bad = dict(init)
    first = next(iter(bad))
    bad[first] = np.zeros((3, 3), np.float32)
    with pytest.raises(weights.WeightsError, match="has shape"):
        _round(lm_data, tmp_path / "bad", "train", hp, bad)


@pytest.mark.timeout(600)
def test_a_site_without_the_base_model_answers_ineligible_with_the_path(
        federation: Any, lm_data: Path, tmp_path: Path) -> None:
    from tests.fixtures.federation import write_job
    from tests.integration.test_jobs import job_cli, wait_job

    fed = federation
    # site-b's data directory has no model/ beside it: model_dir = "../model" is not there.
    lonely = tmp_path / "elsewhere" / "node-2"
    shutil.copytree(lm_data / "node-2", lonely)
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1")
    fed.start_node("site-a", lm_data / "node-1")
    fed.start_node("site-b", lonely)
    job = write_job(tmp_path / "job.toml", task="causal-lm", rounds=1, min_nodes=1,
                    min_available_nodes=2,
                    hyperparameters={"model_dir": "../model", "lr": 0.001, "batch_size": 16,
                                     "seq_len": 32, "max_steps": 2})
    job_id = job_cli(fed, "submit", str(job))["job_id"]
    done = wait_job(fed, job_id, ("finished", "failed", "stopped"), timeout=400)
    assert done["state"] == "finished", done
    rounds = fed.query("ListRounds", job_id=job_id)["rounds"]
    reasons = [i["reason"] for r in rounds for i in r.get("ineligible", [])
               if i.get("name", i.get("node")) == "site-b"]
    assert reasons, rounds
    assert all(r == f"the base model directory {(lonely.parent / 'model').resolve()} "
               f"(model_dir = '../model') is not on this site" for r in reasons), reasons
    # site-a trained every round; its update was the adapters.
    assert all(u["node"] == "site-a" for r in rounds for u in r["updates"])


def test_the_worker_factory_warm_up_never_loads_the_base_model(
        lm_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every round's worker is forked from a factory warmed on the previous round's task; for a
    # language model that must not mean a multi-gigabyte base model loaded on the CPU.
    from fedgpu.node.rounds import worker
    from fedgpu.node.tasks.causal_lm import adapters

    def refuse(*_: object) -> None:
        raise AssertionError("the warm-up loaded the base model")

    monkeypatch.setattr(adapters, "load", refuse)
    worker._warm_up({"task_name": "causal-lm", "data_dir": str(lm_data / "node-1"),
                     "hyperparameters": {"model_dir": str(lm_data / "model"), "batch_size": 4}})
    assert "peft" in sys.modules and "transformers" in sys.modules
