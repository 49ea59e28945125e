"""mode = "evaluate": the job file's rules (fedgpu/core/job/eval_modes.py) and its one round in
the real engine (server/rounds/scoring.py), with fake nodes answering through the same call
the Federation service makes (as tests/unit/test_engine.py does). Over real processes:
tests/integration/test_evaluate_mode.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedgpu.core.constants import RunState, Transport
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.proto import pb
from fedgpu.server.jobs.job_checkpoint import JobCheckpoint
from fedgpu.server.jobs.memory_store import MemoryStore
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.receive import ingest
from fedgpu.server.rounds.scoring import ScorePlan
from fedgpu.server.views import evaluation
from tests.unit.test_engine import _receive

W0 = {"w": np.arange(4, dtype=np.float32)}
BASE = {"task": "t", "mode": "evaluate", "initial_weights": "m.safetensors"}


@pytest.mark.parametrize(("extra", "words"), [
    ({"strategy": "fedadam"}, "'strategy' only mean something for training"),
    ({"fraction": 0.5, "local_steps": 3}, "'fraction', 'local_steps' only mean"),
    ({"rounds": 4}, "runs one round: leave 'rounds' out"),
    ({"evaluate": False}, "'evaluate = false' leaves it nothing to do"),
    ({"model_from_job": "abc"}, "keep one"),
    ({"initial_weights": None}, "set 'initial_weights'"),
    ({"update_codec": "topk", "topk_fraction": 0.1}, "only apply to training"),
    ({"privacy": {"mode": "central", "noise_multiplier": 1.0, "clip_norm": 1.0}},
     "mode = 'evaluate' uploads no update"),
    ({"secure_aggregation": True, "min_nodes": 3}, "star mode only"),
])
def test_keys_that_only_mean_something_for_training_are_refused(
        extra: dict[str, Any], words: str) -> None:
    raw = {k: v for k, v in {**BASE, **extra}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        parse_job(raw)
    assert words in str(err.value)


def test_an_evaluate_job_runs_one_round_and_model_from_job_needs_the_mode() -> None:
    job = parse_job({"task": "t", "mode": "evaluate", "model_from_job": "a1b2"})
    assert job.rounds == 1 and job.model_from_job == "a1b2"
    assert parse_job(job.to_dict()) == job  # stored and read back unchanged
    assert parse_job({**BASE, "rounds": 1}).rounds == 1
    with pytest.raises(ConfigError, match="needs mode = \"evaluate\""):
        parse_job({"task": "t", "model_from_job": "a1b2"})
    with pytest.raises(ConfigError, match="must be a job id"):
        parse_job({"task": "t", "mode": "evaluate", "model_from_job": "a b\n"})


# name -> (held-out examples, metrics) a fake node reports; None: it fails the task.
Scores = dict[str, tuple[int, dict[str, float]] | None]


async def _scorer(orch: Orchestrator, node: Node, scores: Scores,
                  seen: list[pb.TaskHeader]) -> None:
    answered: set[str] = set()
    while not orch.finished.is_set():
        task = orch.task_for(node)
        if task is None or task.task_id in answered:
            node.wakeup.clear()
            try:
                await asyncio.wait_for(node.wakeup.wait(), timeout=0.05)
            except TimeoutError:
                pass
            continue
        answered.add(task.task_id)
        seen.append(task.header)
        header = pb.UpdateHeader(node_id=node.node_id, task_id=task.task_id, round=task.round,
                                 kind=task.kind, evaluated_round=task.header.evaluated_round)
        score = scores[node.name]
        if score is None:
            header.failed, header.error = True, "boom"
        else:
            header.num_eval_examples = score[0]
            header.eval_metrics.update(score[1])
        await ingest(orch, node, header, _receive(None), Transport.GRPC)


def run_scoring(tmp_path: Path, scores: Scores, **job: Any
                ) -> tuple[Orchestrator, list[pb.TaskHeader]]:
    spec = {**BASE, "min_nodes": 2, "round_retries": 0, "round_deadline_s": 5, **job}
    seen: list[pb.TaskHeader] = []

    async def go() -> Orchestrator:
        registry = Registry(heartbeat_interval_s=3600)
        nodes = [registry.register(n, "test", "0", {}, {}, {}, ["t"]) for n in scores]
        store = MemoryStore()
        store.add_job(job_id="j", name="j", task="t", job_toml="", job=spec, source="submit",
                      source_sha256="", submitted_by="test", rounds=1, state_dir="jobs/j")
        parsed = parse_job(spec)
        orch = Orchestrator(parsed, registry, initial_weights=W0, plan=ScorePlan(parsed),
                            checkpointer=JobCheckpoint(tmp_path, store, "j"), job_id="j")
        workers = [asyncio.create_task(_scorer(orch, n, scores, seen)) for n in nodes]
        try:
            await asyncio.wait_for(orch.run(), 20)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        return orch

    return asyncio.run(go()), seen


def test_every_site_scores_the_model_once_and_nothing_is_trained(tmp_path: Path) -> None:
    orch, seen = run_scoring(tmp_path, {
        "a": (100, {"loss": 0.5, "accuracy": 0.9}),
        "b": (300, {"loss": 1.0, "accuracy": 0.5}),
        "c": None})  # a site that fails is listed, the others' scores stand
    assert orch.state == RunState.FINISHED, orch.error
    # One evaluate task per site, each with the model; no training task, no final round.
    assert sorted((h.kind, h.round) for h in seen) == [(pb.TASK_KIND_EVALUATE, 1)] * 3
    assert all(h.payload_size > 0 for h in seen)
    (rec,) = orch.history.dicts()
    assert rec["status"] == "finished" and rec["num_examples"] == 0
    assert [f["node"] for f in rec["failures"]] == ["c"]
    ev = evaluation.summary([rec])
    assert ev is not None
    assert [(e["node"], e["num_examples"]) for e in ev["per_node"]] == [("a", 100), ("b", 300)]
    assert ev["accuracy"] == pytest.approx((0.9 * 100 + 0.5 * 300) / 400)
    assert ev["loss"] == pytest.approx((0.5 * 100 + 1.0 * 300) / 400)
    # The model is the one given, committed as the model of round 1 (`job model` serves it).
    assert orch.global_round == 1 and orch.completed
    np.testing.assert_array_equal(orch.global_weights["w"], W0["w"])
    # Nothing was filed as the evaluation of the starting model.
    assert orch.history.initial_eval is None


def test_a_task_that_scores_nothing_fails_the_job_with_the_reason(tmp_path: Path) -> None:
    orch, _ = run_scoring(tmp_path, {"a": (0, {}), "b": (0, {})}, round_retries=3)
    assert orch.state == RunState.FAILED
    assert "reported no held-out examples" in (orch.error or "")
    assert "it has no evaluation" in (orch.error or "")
    # Not retried: the task, not the sites, is what lacks an evaluation.
    assert len(orch.history.records) == 1


def test_too_few_answers_retry_then_fail(tmp_path: Path) -> None:
    lone: Callable[[], Scores] = lambda: {"a": (10, {"loss": 1.0}), "b": None}  # noqa: E731
    orch, seen = run_scoring(tmp_path, lone(), round_retries=1)
    assert orch.state == RunState.FAILED and len(seen) == 4
    assert [r.status for r in orch.history.records] == ["retried", "retried"]


def test_fedgpu_run_refuses_model_from_job_before_starting_anything(tmp_path: Path) -> None:
    # Its aggregator is a fresh one: there is no earlier job to take the model from.
    from tests.fixtures.federation import cli

    job = tmp_path / "job.toml"
    job.write_text('task = "digits"\nmode = "evaluate"\nmodel_from_job = "a1b2c3"\n')
    r = cli("run", "--job", str(job), "--run-dir", str(tmp_path / "run"))
    assert r.returncode != 0 and "fedgpu run starts a fresh one" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_model_from_job_must_name_a_job_of_the_task_that_did_not_fail(tmp_path: Path) -> None:
    from fedgpu.core.constants import JobState
    from fedgpu.server.jobs.earlier import check_earlier, earlier_model

    store = MemoryStore()
    for job_id, task in (("done", "t"), ("other", "u"), ("broke", "t")):
        store.add_job(job_id=job_id, name=job_id, task=task, job_toml="", job={"task": task},
                      source="submit", source_sha256="", submitted_by="test", rounds=1,
                      state_dir=f"jobs/{job_id}")
    store.update("broke", state=JobState.FAILED)

    def scoring(earlier: str) -> Any:
        return parse_job({"task": "t", "mode": "evaluate", "model_from_job": earlier})

    check_earlier(store, scoring("done"))  # queued still: it may finish first
    for earlier, words in (("nope", "no job 'nope'"), ("other", "ran task 'u', not 't'"),
                           ("broke", "job broke failed, so it has no final model")):
        with pytest.raises(ConfigError, match=words):
            check_earlier(store, scoring(earlier))
    # At start, only a finished job's checkpoint is read.
    with pytest.raises(ConfigError, match="is queued, not finished"):
        earlier_model(store, tmp_path, "done")
    store.update("done", state=JobState.FINISHED)
    with pytest.raises(ConfigError, match="left no model"):
        earlier_model(store, tmp_path, "done")
