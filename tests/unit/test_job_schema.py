"""The job schema (fedgpu/core/job/): one declaration per key drives the parse, the refusals
(with the nearest known key for a typo), the combinations (read from the strategy table's
capabilities, not from name lists) and the resume rule."""

from __future__ import annotations

from typing import Any

import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Job, parse_job, resume_keys
from fedgpu.core.job.schema import SECTIONS, keys_of
from fedgpu.core.job.strategies import JOB_STRATEGIES, STRATEGY_SPECS


@pytest.mark.parametrize(("raw", "words"), [
    ({"round": 3}, "unknown key(s) round (did you mean 'rounds'?)"),
    ({"min_node": 2}, "(did you mean 'min_nodes'?)"),
    ({"update_codex": "int8"}, "(did you mean 'update_codec'?)"),  # a flat section's key
    ({"resources": {"gpus": "none"}}, "in [resources]: gpus (did you mean 'gpu'?)"),
    ({"strategy": "fedavgg"}, "got 'fedavgg' (did you mean 'fedavg'?)"),
    ({"mode": "asyncc"}, "(did you mean 'async'?)"),
    ({"strategy": "fedadam", "strategy_params": {"etaa": 0.1}}, "(did you mean 'eta'?)"),
])
def test_typos_get_the_nearest_known_name(raw: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_job({"task": "digits", **raw}, "job.toml")
    assert words in str(refused.value)


def test_every_declared_default_passes_its_own_check() -> None:
    for k in keys_of(Job):
        if k.default is None or k.required:
            continue
        assert k.read({k.name: k.default}, "job") == k.default, k.name


def test_a_stored_job_reads_back_equal() -> None:
    raw = {"task": "digits", "rounds": 7, "min_nodes": 3, "strategy": "fedadam",
           "strategy_params": {"beta1": 0.8}, "hyperparameters": {"lr": 0.1},
           "resources": {"gpu": "required", "min_gpu_free_mib": 100},
           "secure_aggregation": {"clip": 2.0},
           "privacy": {"mode": "distributed", "clip_norm": 1.0, "noise_multiplier": 1.0},
           "name": "a job", "wire_dtype": None}
    job = parse_job(raw)
    assert Job.from_dict(job.to_dict()) == job
    # [strategy_params] is kept as written (an old alias too): a stored job and its
    # checkpoint compare equal across versions (the resume rule compares it).
    assert job.strategy_params == {"beta1": 0.8}


@pytest.mark.parametrize("name", JOB_STRATEGIES)
def test_secure_aggregation_follows_the_strategy_table(name: str) -> None:
    raw = {"task": "digits", "min_nodes": 3, "strategy": name, "secure_aggregation": True}
    problem = STRATEGY_SPECS[name].secagg_problem
    if problem is None:
        assert parse_job(raw).secure_aggregation is not None
    else:
        with pytest.raises(ConfigError, match="cannot run with secure_aggregation"):
            parse_job(raw)


@pytest.mark.parametrize("name", JOB_STRATEGIES)
def test_privacy_follows_the_strategy_table(name: str) -> None:
    raw = {"task": "digits", "strategy": name,
           "privacy": {"mode": "central", "clip_norm": 1.0, "noise_multiplier": 1.0}}
    if STRATEGY_SPECS[name].dp_ok:
        assert parse_job(raw).privacy is not None
    else:
        with pytest.raises(ConfigError, match="needs a strategy that averages"):
            parse_job(raw)


@pytest.mark.parametrize("name", JOB_STRATEGIES)
def test_compressed_updates_follow_the_strategy_table(name: str) -> None:
    raw = {"task": "digits", "strategy": name, "update_codec": "int8"}
    if STRATEGY_SPECS[name].dense_only:
        with pytest.raises(ConfigError, match="needs every update dense"):
            parse_job(raw)
    else:
        assert parse_job(raw).hetero.update_codec == "int8"


def test_resume_rule_and_sections_are_declared_once() -> None:
    assert resume_keys() == tuple(k.name for k in keys_of(Job) if k.resume)
    assert set(resume_keys()) == {"task", "mode", "strategy", "strategy_params",
                                  "local_params"}
    assert list(SECTIONS) == ["resources", "secure_aggregation", "privacy", "hetero",
                             "statistics", "transfer"]
    travels = {k.name for k in keys_of(Job) if k.travels}
    assert {"task", "hyperparameters", "seed"} <= travels
    assert not {"strategy", "initial_weights", "task_dir"} & travels
