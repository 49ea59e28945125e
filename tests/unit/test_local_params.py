"""Personalised layers (job key local_params): the job key's checks, the pure matching
(fedgpu/core/local_params.py) and a site's rounds in-process (node/rounds/local_state.py
through the runner): local tensors stay out of the update, are kept per site across rounds and
are what the site's evaluation uses.

Threat model: local_params protects the chosen tensors of a site's model from everyone outside
the site, the aggregator included: they are never in an update (their bytes never cross the
wire after the starting model). The aggregator still learns the shared tensors (or, with secure
aggregation, their sum), from which something about the local ones may be inferred; the
starting values of local tensors come from the aggregator's global model and hold no site
data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedgpu.core import codec, local_params
from fedgpu.core.datasets import split_digits
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.core.task_schemas import ENGINE_KEYS
from fedgpu.node import weights
from fedgpu.node.rounds import local_state, runner
from fedgpu.node.rounds.workfiles import WEIGHTS_IN, WEIGHTS_OUT

HEAD = ["fc2.*"]


def test_job_key_parses_patterns_and_the_fedbn_preset() -> None:
    job = parse_job({"task": "digits", "local_params": ["head.*", "*.bn*", "head.*"]})
    assert job.local_params == ("head.*", "*.bn*")  # duplicates dropped, order kept
    assert parse_job(job.to_dict()) == job  # stored and read back equal
    assert parse_job({"task": "digits", "local_params": "fedbn"}).local_params == \
        local_params.FEDBN
    assert parse_job({"task": "digits"}).local_params == ()


@pytest.mark.parametrize(("value", "extra", "needle"), [
    ("heads", {}, "or one of 'fedbn'"),
    (7, {}, "must be a list of glob patterns"),
    ([""], {}, "'local_params[0]' must be a glob pattern"),
    (["x" * 257], {}, "1-256 printable characters"),
    (["a\nb"], {}, "printable"),
    ([f"p{i}" for i in range(65)], {}, "at most 64"),
    (["fc2.*"], {"mode": "ring", "min_nodes": 3}, "in ring mode"),
    (["fc2.*"], {"hyperparameters": {"local_params_run": "x"}}, "runner's own"),
])
def test_job_key_refuses_bad_values(value: object, extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match="local_params") as info:
        parse_job({"task": "digits", "local_params": value, **extra})
    assert needle in str(info.value)


def test_matching_is_whole_name_and_case_sensitive() -> None:
    names = ["conv1.weight", "bn1.weight", "layers.0.bn2.running_var", "fc.weight", "FC.bias"]
    shared, local = local_params.split(dict.fromkeys(names, 0), ["*.bn*", "bn*", "fc.*"])
    assert sorted(local) == ["bn1.weight", "fc.weight", "layers.0.bn2.running_var"]
    assert sorted(shared) == ["FC.bias", "conv1.weight"]
    assert local_params.unmatched(["fc.*", "head.*"], names) == ["head.*"]
    why = local_params.problem(["head.*"], names)
    assert why is not None and "'head.*'" in why and "match no tensor" in why
    assert "nothing would be shared" in (local_params.problem(["*"], names) or "")
    assert local_params.problem(["fc.*"], names) is None
    # The aggregate of the shared tensors, completed with the model's own local ones, in order.
    model = {"a": 1, "fc.w": 2, "b": 3}
    assert list(local_params.merged(model, {"b": 30, "a": 10}, ["fc.*"]).items()) == \
        [("a", 10), ("fc.w", 2), ("b", 30)]
    new = {"a": 10}
    assert local_params.merged(model, new, []) is new
    # The runner's keys are never taken for a task's own hyperparameters.
    assert {local_params.HPARAM, local_params.RUN_HPARAM} <= set(ENGINE_KEYS)


def test_take_refuses_a_run_id_that_could_name_another_file() -> None:
    hp: dict[str, Any] = {"local_params": ["fc2.*"], "local_params_run": "../../etc", "lr": 1}
    with pytest.raises(ValueError, match="must be a run id"):
        local_state.take(hp)
    hp = {"local_params": ["fc2.*"], "local_params_run": "abc123", "lr": 1}
    assert local_state.take(hp) == local_state.LocalAsk(("fc2.*",), "abc123")
    assert hp == {"lr": 1}  # taken out before the task sees the rest


# ---- a site's rounds, in-process --------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split_digits(tmp_path_factory.mktemp("split"), 3, seed=1)[0]


def _spec(kind: str, data: Path, state: Path | None, local: list[str] | None
          ) -> runner.RoundSpec:
    hp: dict[str, Any] = {"local_epochs": 1}
    if local is not None:
        hp.update(local_params=local, local_params_run="run1")
    return runner.parse_spec({
        "kind": kind, "task_name": "digits", "hyperparameters": hp, "seed": 1, "round": 1,
        "data_dir": str(data), "device": "cpu", "torch_threads": 1,
        **({"local_state_dir": str(state)} if state is not None else {})})


def _global(workdir: Path, data: Path) -> dict[str, np.ndarray]:
    runner.run_round(runner.parse_spec({
        "kind": "init", "task_name": "digits", "hyperparameters": {}, "seed": 1, "round": 0,
        "data_dir": None, "device": "cpu", "torch_threads": 1}), workdir)
    (workdir / WEIGHTS_OUT).rename(workdir / WEIGHTS_IN)
    return weights.read_arrays(workdir / WEIGHTS_IN)


def test_local_tensors_stay_at_the_site_and_come_back_next_round(tmp_path: Path,
                                                                  site: Path) -> None:
    state = tmp_path / "state"
    start = _global(tmp_path, site)
    first = runner.run_round(_spec("train", site, state, HEAD), tmp_path)
    sent, _ = codec.decode((tmp_path / WEIGHTS_OUT).read_bytes())
    # The update holds the shared tensors only, and is smaller by the head's bytes.
    assert sorted(sent) == sorted(n for n in start if not n.startswith("fc2."))
    kept = codec.read_file(state / "local-params-run1.safetensors")
    assert sorted(kept) == ["fc2.bias", "fc2.weight"]
    assert first.train_metrics["local_tensors"] == 0.0  # nothing kept before round 1
    assert not np.array_equal(kept["fc2.weight"], start["fc2.weight"])  # trained here

    # Next round the aggregator sends its own (starting) head again: the site's copy wins,
    # so evaluation scores the site's head: the same accuracy as a model holding it.
    ev = runner.run_round(_spec("evaluate", site, state, HEAD), tmp_path)
    assert ev.train_metrics["local_tensors"] == 2.0
    with_head = {**weights.read_arrays(tmp_path / WEIGHTS_IN), **kept}
    weights.write_weights(tmp_path / WEIGHTS_IN, with_head)
    plain = runner.run_round(_spec("evaluate", site, None, None), tmp_path)
    assert ev.eval_metrics == plain.eval_metrics
    weights.write_weights(tmp_path / WEIGHTS_IN, start)
    fresh = runner.run_round(_spec("evaluate", site, None, None), tmp_path)
    assert fresh.eval_metrics != ev.eval_metrics  # the starting head scores otherwise


def test_saved_layers_that_do_not_fit_the_model_are_refused(tmp_path: Path,
                                                            site: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    _global(tmp_path, site)
    weights.write_weights(state / "local-params-run1.safetensors",
                          {"fc2.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(local_state.LocalStateError, match="do not fit this model") as info:
        runner.run_round(_spec("train", site, state, HEAD), tmp_path)
    assert runner.classify(info.value).kind == "bad_input"


def test_a_resumed_run_keeps_its_local_params(tmp_path: Path) -> None:
    """local_params must match on resume (a changed list would share a site's own layers, or
    freeze shared ones); a checkpoint from before the key existed kept nothing local."""
    from fedgpu.server.jobs import resume

    job = parse_job({"task": "digits", "local_params": ["fc2.*"]})
    saved = json.loads(json.dumps(job.to_dict()))  # as state.json holds it: lists
    state = {"job": saved, "run_id": "r1", "global_round": 1}
    resume.check(job, {}, state, None, tmp_path)  # the same list: resumes
    other = parse_job({"task": "digits", "local_params": ["fc1.*"]})
    with pytest.raises(ConfigError, match="local_params"):
        resume.check(other, {}, state, None, tmp_path)
    old = {k: v for k, v in saved.items() if k != "local_params"}
    resume.check(parse_job({"task": "digits"}), {}, {**state, "job": old}, None, tmp_path)
    with pytest.raises(ConfigError, match="local_params"):
        resume.check(job, {}, {**state, "job": old}, None, tmp_path)


@pytest.mark.parametrize("extra", [
    {"hyperparameters": {"update_codec": "int8", "update_codec_run": "run1"}},
    {"privacy": {"clip_norm": 0.5, "noise_multiplier": 0.1}},
])
def test_codecs_and_local_dp_cover_the_shared_tensors_only(tmp_path: Path, site: Path,
                                                           extra: dict[str, Any]) -> None:
    """An update codec compresses, and local DP clips and noises, the shared tensors: the
    aggregator's checks against the shared spec pass; the head stays whole at the site."""
    from fedgpu.core.update_codecs import decode_update

    start = _global(tmp_path, site)
    raw = {"kind": "train", "task_name": "digits", "seed": 1, "round": 1,
           "data_dir": str(site), "device": "cpu", "torch_threads": 1,
           "local_state_dir": str(tmp_path / "state"),
           "hyperparameters": {"local_params": HEAD, "local_params_run": "run1",
                               **extra.get("hyperparameters", {})}}
    if "privacy" in extra:
        raw["privacy"] = extra["privacy"]
    result = runner.run_round(runner.parse_spec(raw), tmp_path)
    sent, meta = codec.decode((tmp_path / WEIGHTS_OUT).read_bytes())
    spec = codec.spec(local_params.shared(start, HEAD))
    if "privacy" in extra:
        assert codec.spec(sent) == spec and result.train_metrics["ldp_clipped"] == 1.0
    else:
        assert sorted(decode_update(sent, meta, spec)) == sorted(spec)
    kept = codec.read_file(tmp_path / "state" / "local-params-run1.safetensors")
    assert sorted(kept) == ["fc2.bias", "fc2.weight"]


def test_the_aggregator_refuses_an_update_that_holds_a_local_tensor() -> None:
    """What a training update must match leaves the local tensors out: an update that holds
    one (a site that would leak its head, or a client that ignores the job) is refused by name,
    before it touches the aggregate."""
    import asyncio
    from types import SimpleNamespace

    from fedgpu.server.rejections import Reject, UpdateRejected
    from fedgpu.server.rounds.answers import Answers
    from fedgpu.server.rounds.validation import check_spec

    model = {"conv.w": np.zeros((2, 2), np.float32), "fc2.weight": np.zeros(3, np.float32)}
    job = parse_job({"task": "digits", "local_params": ["fc2.*"]})
    answers = Answers(SimpleNamespace(job=job, global_spec=codec.spec(model)),  # type: ignore[arg-type]
                      asyncio.Lock())
    spec = answers.wire_spec
    assert spec is not None and sorted(spec) == ["conv.w"]
    check_spec({"conv.w": model["conv.w"]}, spec)
    with pytest.raises(UpdateRejected, match="unexpected fc2.weight") as info:
        check_spec(model, spec)
    assert info.value.reason is Reject.NAMES


def test_central_dp_clips_over_the_shared_tensors_only() -> None:
    """The engine hands its strategy the shared part of the global model (Orchestrator.
    shared_weights): client-level DP measures each update's norm there, so a large local head,
    which never arrives, neither counts toward the clip nor is noised into the model."""
    from fedgpu.core.privacy import parse_privacy
    from fedgpu.server.strategies import make_strategy
    from fedgpu.server.strategies.update import UpdateIn

    model = {"conv.w": np.zeros(4, np.float32), "fc2.weight": np.full(4, 9.0, np.float32)}
    privacy = parse_privacy({"mode": "central", "clip_norm": 1.0, "noise_multiplier": 0.0})
    strategy = make_strategy("fedavg", {}, privacy, 3)
    strategy.begin_round(local_params.shared(model, HEAD))
    for _ in range(2):  # each update moves conv.w by norm 0.5: under the clip, kept whole
        strategy.add(UpdateIn({"conv.w": np.full(4, 0.25, np.float32)}, 10))
    new = local_params.merged(model, dict(strategy.finish()), HEAD)
    assert sorted(new) == ["conv.w", "fc2.weight"]
    np.testing.assert_allclose(new["conv.w"], np.full(4, 0.25), atol=1e-6)
    assert np.array_equal(new["fc2.weight"], model["fc2.weight"])


@pytest.mark.parametrize("mode, extra, why", [
    ("evaluate", {"initial_weights": "w.safetensors"}, "only mean something for training"),
    ("statistics", {}, "drop 'local_params'"),
])
def test_modes_without_training_refuse_personalised_layers(mode: str, extra: dict,
                                                           why: str) -> None:
    from fedgpu.core.errors import ConfigError
    from fedgpu.core.job import parse_job

    with pytest.raises(ConfigError, match=why):
        parse_job({"task": "digits", "mode": mode, "local_params": ["fc2.*"], **extra})
