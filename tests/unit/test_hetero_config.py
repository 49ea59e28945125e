"""Job keys for unlike sites (local_work/round_train_s, update_codec/topk_fraction) and the
runner's time budget."""

from __future__ import annotations

import time
from typing import Any

import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.hetero_config import LocalWork
from fedgpu.core.job import parse_job
from fedgpu.core.update_codecs import UpdateCodec
from fedgpu.server.rounds.work import task_hyperparameters
from tests.unit.test_loop import Noise, Recorder, _loop


def job(**keys: Any) -> Any:
    return parse_job({"task": "digits", **keys})


def test_keys_parse_and_round_trip_through_to_dict() -> None:
    j = job(local_work="time", round_train_s=12, update_codec="topk", topk_fraction=0.05,
            strategy="fednova", hyperparameters={"lr": 0.1})
    assert j.hetero.local_work is LocalWork.TIME and j.hetero.round_train_s == 12.0
    assert j.hetero.update_codec is UpdateCodec.TOPK and j.hetero.topk_fraction == 0.05
    again = parse_job(j.to_dict())
    assert again == j
    assert task_hyperparameters(j, "run1") == {
        "lr": 0.1, "round_train_s": 12.0, "update_codec": "topk", "topk_fraction": 0.05,
        "update_codec_run": "run1"}
    # A job without them: no new keys in its documents, no budget sent.
    plain = job()
    assert not {"local_work", "update_codec", "hetero"} & set(plain.to_dict())
    assert task_hyperparameters(plain) == {}


@pytest.mark.parametrize(("keys", "message"), [
    ({"local_work": "steps"}, "'local_work' must be one of epochs, time"),
    ({"local_work": "time"}, "'round_train_s' must be a number of seconds in (0, "),
    ({"local_work": "time", "round_train_s": 700}, "round_deadline_s = 600"),
    ({"round_train_s": 5}, "'round_train_s' needs local_work = \"time\""),
    ({"local_work": "time", "round_train_s": 5, "mode": "ring", "min_nodes": 2,
      "fraction": 1.0}, "local_work = \"time\" is not for ring jobs"),
    ({"update_codec": "int4"}, "'update_codec' must be one of none, int8, topk"),
    ({"update_codec": "int8", "topk_fraction": 0.1}, "'topk_fraction' needs update_codec"),
    ({"update_codec": "topk", "topk_fraction": 0}, "'topk_fraction' must be a number in (0, 1]"),
    ({"update_codec": "int8", "strategy": "median"}, "needs every update dense"),
    ({"update_codec": "int8", "wire_dtype": "bf16"}, "choose update_codec or wire_dtype"),
    ({"buffer_size": 2}, "buffer_size need mode = \"async\""),
    ({"mode": "async", "strategy": "median"}, "needs every update of a synchronised round"),
    ({"mode": "async", "strategy": "fedadam"}, "is not supported in async mode yet"),
    ({"mode": "async", "buffer_size": 0}, "'buffer_size' must be an integer from 1 to"),
    ({"mode": "async", "buffer_size": 10**12}, "'buffer_size' must be an integer from 1 to"),
    ({"mode": "async", "max_staleness": -1}, "'max_staleness' must be an integer from 0 to"),
    ({"mode": "async", "max_staleness": 2**40}, "'max_staleness' must be an integer from 0"),
    ({"mode": "async", "staleness_weighting": "exp"}, "must be one of sqrt, poly, constant"),
])
def test_bad_keys_are_refused_by_name(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        job(**keys)
    assert message in str(err.value)


def test_async_keys_default_and_round_trip() -> None:
    j = job(mode="async", min_nodes=3)
    assert (j.hetero.buffer_size, j.hetero.max_staleness) == (3, 4)
    j = job(mode="async", buffer_size=2, max_staleness=6, staleness_weighting="poly")
    assert parse_job(j.to_dict()) == j


def test_a_time_budget_trains_epoch_after_epoch_until_it_is_spent() -> None:
    task = Recorder()
    # 16 examples, batches of 8, 5 ms per example: an epoch (2 steps) takes ~0.1 s; 1 s budget.
    loop = _loop(task, local_epochs=1, round_train_s=1.0)
    started = time.perf_counter()
    out = loop.train(Noise(16, delay_s=0.005), seed=0, round_started=started)
    assert out.seconds >= 1.0
    assert out.metrics["steps"] > 2  # more than the one epoch local_epochs asks for
    assert out.metrics["examples"] == out.metrics["steps"] * 8
