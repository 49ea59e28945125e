"""mode = "cross-site" in parts: the job file's rules (fedgpu/core/job/eval_modes.py), the site
policy's share_local_model and its one decision function, the node's kept local models
(node/local_models.py: one per job, the newest KEEP_JOBS jobs, a size limit, read back by a
new instance as after a restart) and the matrix the views build from round records. Over real
processes: tests/integration/test_cross_site_mode.py.

Threat model of the local models: a site's local model leaves it only when its own policy
says share_local_model = true (no policy, or the key absent: it stays), and a model that is
not the plain trained weights (noised, compressed, layers left out) is never kept."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedgpu.cli.common.cross_site_text import matrix_lines
from fedgpu.core import codec
from fedgpu.core.cross_site_matrix import matrix
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.core.site_policy import local_model_refusal, parse
from fedgpu.node.local_models import LocalModels
from fedgpu.proto import pb

BASE = {"task": "digits", "mode": "cross-site", "model_from_job": "a1b2c3"}


@pytest.mark.parametrize(("extra", "words"), [
    ({"model_from_job": None}, "set 'model_from_job' to its id"),
    ({"initial_weights": "m.safetensors"}, "'initial_weights' has no place in it"),
    ({"strategy": "fedadam"}, "'strategy' only mean something for training"),
    ({"rounds": 3}, "trains no rounds: leave 'rounds' out"),
    ({"evaluate": False}, "'evaluate = false' leaves it nothing to do"),
    ({"local_params": ["head.*"]}, "'local_params' only mean something for training"),
    ({"update_codec": "topk", "topk_fraction": 0.1}, "only apply to training"),
])
def test_a_cross_site_job_file_that_makes_no_sense_is_refused(
        extra: dict[str, Any], words: str) -> None:
    raw = {k: v for k, v in {**BASE, **extra}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        parse_job(raw)
    assert words in str(err.value)


def test_a_cross_site_job_names_its_training_job_and_reads_back_unchanged() -> None:
    job = parse_job(BASE)
    assert job.rounds == 1 and job.model_from_job == "a1b2c3" and job.mode == "cross-site"
    assert parse_job(job.to_dict()) == job
    with pytest.raises(ConfigError, match="\"evaluate\" or \"cross-site\""):
        parse_job({"task": "digits", "model_from_job": "a1b2c3"})


def test_a_site_shares_its_local_model_only_when_its_policy_says_so() -> None:
    assert "none set" in (local_model_refusal(None) or "")
    assert local_model_refusal(parse("max_rounds = 5\n")) == (
        "site policy: share_local_model = false")
    shared = parse("share_local_model = true\n")
    assert local_model_refusal(shared) is None
    assert shared.to_dict() == {"share_local_model": True}
    with pytest.raises(ConfigError, match="share_local_model must be true or false"):
        parse('share_local_model = "yes"\n')


def _task(job_id: str, round_number: int = 1, **fields: Any) -> pb.TaskHeader:
    fields.setdefault("job_terms", pb.JobTerms(job_id=job_id))
    return pb.TaskHeader(task_id=f"t{round_number}", round=round_number,
                         kind=pb.TASK_KIND_TRAIN, **fields)


def _weights(path: Path, value: float) -> Path:
    encoded = codec.encode({"w": np.full(4, value, dtype=np.float32)})
    path.write_bytes(b"".join(codec.iter_chunks(encoded)))
    return path


def _ask(job_id: str) -> pb.TaskHeader:
    return pb.TaskHeader(task_id="x", round=1, kind=pb.TASK_KIND_LOCAL_MODEL,
                         local_model_of=job_id)


def test_the_node_keeps_one_local_model_per_job_for_its_newest_jobs(tmp_path: Path) -> None:
    models = LocalModels(tmp_path, 1 << 20, keep_jobs=2)
    models.keep(_task("job1", 1), _weights(tmp_path / "r1", 1.0))
    models.keep(_task("job1", 2), _weights(tmp_path / "r2", 2.0))  # the last round replaces
    path, _ = models.find("job1")
    assert path is not None and codec.decode(path.read_bytes())[0]["w"][0] == 2.0
    assert sorted(p.name for p in (tmp_path / "local_models").iterdir()) == [
        "job1.json", "job1.safetensors"]
    for n, job in enumerate(("job2", "job3")):
        os.utime(tmp_path / "local_models" / "job1.json", (n, n))  # job1 is the oldest
        models.keep(_task(job), _weights(tmp_path / f"w-{job}", 3.0))
    # Only the newest two jobs are kept; a node started again reads what is on disk.
    again = LocalModels(tmp_path, 1 << 20, keep_jobs=2)
    assert again.find("job1")[0] is None and "kept no local model" in again.find("job1")[1]
    assert again.find("job2")[0] is not None and again.find("job3")[0] is not None
    assert not (tmp_path / "local_models" / "job1.safetensors").exists()


@pytest.mark.parametrize(("fields", "why"), [
    ({"privacy_local": pb.PrivacyLocalDp(clip_norm=1.0, noise_multiplier=1.0)},
     "differential privacy ([privacy] mode = 'local')"),
    ({"job_terms": pb.JobTerms(job_id="job1", dp_mode="central")},
     "differential privacy ([privacy] mode = 'central')"),
    ({"secagg_setup": b"setup"}, "secure aggregation"),
    ({"hyperparameters_json": json.dumps({"update_codec": "topk"})}, "compressed deltas"),
    ({"hyperparameters_json": json.dumps({"local_params": ["head.*"]})}, "local_params"),
])
def test_an_update_that_is_not_the_plain_model_is_not_kept(
        tmp_path: Path, fields: dict[str, Any], why: str) -> None:
    models = LocalModels(tmp_path, max_bytes=1 << 20)
    models.keep(_task("job1", **fields), _weights(tmp_path / "w", 1.0))
    path, reason = models.find("job1")
    assert path is None and why in reason, reason
    assert not (tmp_path / "local_models" / "job1.safetensors").exists()


def test_a_model_over_the_limit_is_noted_not_kept(tmp_path: Path) -> None:
    models = LocalModels(tmp_path, max_bytes=64)
    models.keep(_task("job1"), _weights(tmp_path / "w", 1.0))
    assert "over the node's limit of 64 bytes" in models.find("job1")[1]


def test_the_answer_to_a_cross_site_task(tmp_path: Path) -> None:
    from fedgpu.core.audit import AuditLog

    models = LocalModels(tmp_path, 1 << 20, AuditLog(tmp_path / "audit.jsonl"), "aggregator x")
    models.keep(_task("job1"), _weights(tmp_path / "w", 1.0))
    share = parse("share_local_model = true\n")
    header, path = models.answer(_ask("job1"), "n1", share, [])
    assert path is not None and not header.failed and header.kind == pb.TASK_KIND_LOCAL_MODEL
    header, path = models.answer(_ask("job1"), "n1", parse("max_rounds = 5\n"), [])
    assert path is None and header.failed and "share_local_model = false" in header.error
    header, path = models.answer(_ask("job1"), "n1", share, ["the job names no study"])
    assert path is None and header.error == "site policy: the job names no study"
    header, path = models.answer(_ask("../etc"), "n1", share, [])
    assert path is None and "is not a job id" in header.error
    # The site's audit log: one record per answer, what left and what was refused.
    audit = (tmp_path / "audit.jsonl").read_text()
    assert audit.count("task.local_model") == 4 and audit.count("SENT") == 1, audit


def _rec(number: int, part: dict[str, Any], per_node: list[tuple[str, float]] = (),
         **extra: Any) -> dict[str, Any]:
    ev = ({"accuracy": sum(a for _, a in per_node) / len(per_node), "loss": 0.5,
           "num_examples": 10 * len(per_node), "nodes": len(per_node),
           "per_node": [{"node": n, "num_examples": 10, "metrics": {"accuracy": a,
                                                                    "loss": 0.5}}
                        for n, a in per_node]} if per_node else None)
    return {"round": number, "status": "finished", "eval": ev, "failures": [],
            "ineligible": [], "cross_site": part, **extra}


def test_the_matrix_shows_every_model_on_every_site_and_says_why_where_none() -> None:
    assert matrix([]) is None
    rounds = [
        _rec(1, {"stage": "collect", "of_job": "j1", "sent": ["a"],
                 "not_sent": {"b": "site policy: share_local_model = false"}}),
        _rec(2, {"stage": "score", "model": "a"}, [("a", 0.9)],
             failures=[{"node": "b", "error": "out of memory"}]),
        _rec(3, {"stage": "score", "model": "global"}, [("a", 0.8), ("b", 0.7)]),
    ]
    m = matrix(rounds)
    assert m is not None and m["sites"] == ["a", "b"] and m["of_job"] == "j1"
    rows = {r["model"]: r for r in m["rows"]}
    assert list(rows) == ["global", "a", "b"]
    assert rows["global"]["cells"]["b"]["accuracy"] == 0.7
    assert rows["a"]["cells"]["b"] == {"why_not": "out of memory"}
    assert rows["b"]["why_not"] == "site policy: share_local_model = false"
    text = "\n".join(matrix_lines(m))
    assert "a (local)" in text and "0.8000" in text and "0.9000" in text
    assert "b (local): not scored: site policy: share_local_model = false" in text
    assert "a (local) on b: out of memory" in text


def test_the_aggregator_keeps_its_own_copy_of_each_local_model_that_fits() -> None:
    from fedgpu.server.rounds.cross_site import CollectPlan

    plan = CollectPlan(parse_job(BASE), {"w": ("F32", (4,))})
    buffer = bytearray(np.arange(4, dtype=np.float32).tobytes())
    plan.take_model("a", {"w": np.frombuffer(buffer, dtype=np.float32)})
    buffer[:] = bytes(16)  # the upload's buffer, reused by the next upload
    assert plan.models["a"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    plan.take_model("b", {"w": np.zeros(5, dtype=np.float32)})
    assert "b" not in plan.models and "does not fit job a1b2c3's model" in plan.not_sent["b"]


def test_fedgpu_run_cross_site_follows_a_training_job_with_a_job_the_schema_takes() -> None:
    import tomllib

    from fedgpu.cli.run import cross_site as run_cross_site
    from fedgpu.cli.run.run_config import demo_job

    trained = demo_job(task="digits", nodes=2, rounds=1, use_gpu=False)
    run_cross_site.check(trained)
    follow = parse_job(tomllib.loads(run_cross_site.job_toml(trained, "abc123")))
    assert follow.mode == "cross-site" and follow.model_from_job == "abc123"
    assert follow.hyperparameters == trained.hyperparameters and follow.min_nodes == 2
    with pytest.raises(ConfigError, match="the job's mode is 'evaluate'"):
        run_cross_site.check(parse_job({"task": "digits", "mode": "evaluate",
                                        "initial_weights": "w.safetensors"}))
    line = run_cross_site.round_line({"round": 2, "nodes_reporting": 2, "eval": {
        "accuracy": 0.5}, "cross_site": {"stage": "score", "model": "node-1"}})
    assert line == "cross-site round 2: node-1's local model scored by 2 node(s), accuracy 0.5000"
    assert run_cross_site.round_line({"round": 1}) is None


def test_max_rounds_counts_training_rounds_not_a_cross_site_jobs_scoring_rounds(
        tmp_path: Path) -> None:
    from fedgpu.core.audit import AuditLog
    from fedgpu.node.site_rules import SiteRules

    rules = SiteRules(parse("max_rounds = 1\nshare_local_model = true\n"), tmp_path,
                      AuditLog(tmp_path / "audit.jsonl"))
    task = pb.TaskHeader(round=3, kind=pb.TASK_KIND_EVALUATE,
                         job_terms=pb.JobTerms(job_id="cs", rounds=1))
    assert rules.refusals(task, "evaluate") == []
    assert rules.refusals(task, "train") == ["round 3 is past the site's maximum 1 per job"]
