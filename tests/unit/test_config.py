"""Job-file validation: every mistake is named with its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Job, load_job, parse_job

ROOT = Path(__file__).resolve().parents[2]


def test_example_job_parses() -> None:
    job = load_job(ROOT / "examples" / "job.toml")
    assert job.task == "digits" and job.rounds == 5 and job.hyperparameters["lr"] == 0.05


def test_defaults() -> None:
    job = parse_job({"task": "digits"})
    assert job == Job(task="digits")


@pytest.mark.parametrize(
    "raw, message",
    [
        ({}, "'task' is required"),
        ({"task": ""}, "'task' must be a task name"),
        ({"task": "d", "rounds": 0}, "'rounds' must be a positive integer"),
        ({"task": "d", "rounds": True}, "'rounds' must be a positive integer"),
        ({"task": "d", "rounds": "5"}, "'rounds' must be a positive integer"),
        ({"task": "d", "min_nodes": 0}, "'min_nodes'"),
        ({"task": "d", "fraction": 0}, "'fraction' must be a number in \\(0, 1\\]"),
        ({"task": "d", "fraction": 1.5}, "'fraction'"),
        ({"task": "d", "round_deadline_s": -1}, "'round_deadline_s'"),
        ({"task": "d", "use_gpu": "yes"}, "'use_gpu' must be true or false"),
        ({"task": "d", "strategy": "magic"}, "'strategy' must be one of fedavg"),
        ({"task": "d", "mode": "mesh"}, "'mode'"),
        ({"task": "d", "roundz": 1}, "unknown key\\(s\\) roundz"),
        ({"task": "d", "hyperparameters": {"lr": [1, 2]}}, "lr must be a number"),
        ({"task": "d", "hyperparameters": {"lr": float("nan")}}, "lr must be finite"),
        ({"task": "d", "hyperparameters": 3}, "'hyperparameters' must be a table"),
        ({"task": "d", "round_retries": -1}, "'round_retries'"),
    ],
)
def test_invalid_jobs(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_job(raw, "job.toml")


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_job(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("task = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_job(bad)


@pytest.mark.parametrize(("extra", "words"), [
    ({"secure_aggregation": True, "mode": "async"}, "needs synchronised rounds"),
    ({"secure_aggregation": True, "update_codec": "int8"}, "masks whole updates"),
    ({"privacy": {"mode": "central", "clip_norm": 1, "noise_multiplier": 1}, "mode": "async"},
     "accounts per synchronised round"),
    ({"privacy": {"mode": "local", "clip_norm": 1, "noise_multiplier": 1},
      "update_codec": "topk"}, "clips and noises whole updates"),
])
def test_features_that_do_not_combine_are_refused_by_name(extra, words):
    with pytest.raises(ConfigError, match=words):
        parse_job({"task": "digits", "min_nodes": 3, **extra}, "job.toml")
