"""A simulated node answers statistics tasks and keeps local_params tensors local, as a real
node does (node/sim/statistics.py, node/sim/personal.py, node/sim/synthetic.py): pure
functions on plain data, no aggregator. The wire end to end: tests/integration/test_sim_modes.py.

Threat models: local_params in tests/unit/test_local_params.py (a site's local tensors never
leave it); the statistics release in docs/explanation/federated-statistics.md (cells under
min_count never leave the site).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedgpu.core import codec, local_params
from fedgpu.core.fedstats import wire
from fedgpu.node.sim import personal, statistics, synthetic
from fedgpu.proto import pb


def _stats_task(**release: object) -> pb.TaskHeader:
    return pb.TaskHeader(kind=pb.TASK_KIND_STATISTICS, round=1,
                         statistics=pb.StatisticsRelease(**release))  # type: ignore[arg-type]


def test_statistics_answer_is_a_release_with_small_cells_held_back() -> None:
    update = pb.UpdateHeader()
    assert statistics.answer(_stats_task(min_count=3, noise="none", epsilon=1, delta=1e-5),
                             update, index=4, records=40)
    released = {c.spec.name: c for c in wire.loads(update.statistics_json)}
    assert set(released) == {"feature", "label"}
    values = dict(statistics.columns(4, 40))
    for spec in statistics.COLUMNS:
        got = released[spec.name]
        assert not got.suppressed and got.count == 40 * spec.per_record
        hist, _ = np.histogram(values[spec], bins=spec.bins, range=(spec.lo, spec.hi))
        threshold = 3 * spec.per_record
        assert list(got.histogram) == [float(c) if c >= threshold else None for c in hist]
    assert any(c is None for c in released["feature"].histogram)


def test_statistics_of_a_site_under_min_count_leave_nothing_but_the_spec() -> None:
    update = pb.UpdateHeader()
    assert statistics.answer(_stats_task(min_count=50, noise="none", epsilon=1, delta=1e-5),
                             update, index=0, records=10)
    doc = json.loads(update.statistics_json)
    assert [c["suppressed"] for c in doc["columns"]] == [True, True]
    assert all("histogram" not in c and "count" not in c for c in doc["columns"])


def test_statistics_with_noise_differ_and_bad_settings_fail_with_the_reason() -> None:
    a, b = pb.UpdateHeader(), pb.UpdateHeader()
    task = _stats_task(min_count=1, noise="laplace", epsilon=1.0, delta=1e-5)
    assert statistics.answer(task, a, 1, 30) and statistics.answer(task, b, 1, 30)
    assert a.statistics_json != b.statistics_json  # noise drawn fresh, never seeded by us
    bad = pb.UpdateHeader()
    assert not statistics.answer(_stats_task(), bad, 1, 30)  # min_count 0: no settings
    assert bad.failed and "min_count" in bad.error and not bad.statistics_json


def _train_task(round_: int, patterns: list[str] | None, run: str = "run1") -> pb.TaskHeader:
    hp = {} if patterns is None else {local_params.HPARAM: patterns,
                                      local_params.RUN_HPARAM: run}
    return pb.TaskHeader(kind=pb.TASK_KIND_TRAIN, round=round_,
                         hyperparameters_json=json.dumps(hp))


def _payload(model: dict[str, np.ndarray]) -> memoryview:
    return memoryview(codec.encode(model).to_bytes())


def test_local_tensors_stay_on_the_simulated_node_and_carry_over_rounds() -> None:
    model = synthetic.synthetic_model(300, 3, seed=1)
    task = _train_task(1, ["layer002.*"])
    patterns, run = personal.ask_of(task.hyperparameters_json)
    assert patterns == ("layer002.*",) and run == "run1"
    layers, noise = personal.LocalLayers(), synthetic.Noise()
    sent = synthetic.trained(noise, 2, task, _payload(model), layers, patterns, run)
    assert sorted(sent) == ["layer000.weight", "layer001.weight"]
    kept = layers.tensors["layer002.weight"]
    assert not np.array_equal(kept, model["layer002.weight"])  # trained, and kept here
    # Round 2: the global model's copy (never updated by the aggregator) is ignored; the
    # node steps its own.
    synthetic.trained(noise, 2, _train_task(2, ["layer002.*"]), _payload(model), layers,
                      patterns, run)
    step2 = synthetic.step_scale(2, 2) * noise.get("layer002.weight", kept.shape)
    np.testing.assert_allclose(layers.tensors["layer002.weight"], kept + step2, rtol=1e-6)
    # Another run (another job) starts over from the global model's layers.
    synthetic.trained(noise, 2, _train_task(1, ["layer002.*"], "run2"), _payload(model),
                      layers, patterns, "run2")
    np.testing.assert_allclose(layers.tensors["layer002.weight"], kept, rtol=1e-6)
    # Without local_params the whole model travels.
    assert personal.ask_of(_train_task(1, None).hyperparameters_json) == ((), "")
    assert sorted(synthetic.trained(noise, 2, _train_task(1, None), _payload(model))) == \
        sorted(model)


def test_secure_change_covers_the_shared_tensors_only() -> None:
    model = synthetic.synthetic_model(300, 3, seed=1)
    task = _train_task(1, ["layer000.*"])
    layers = personal.LocalLayers()
    change = synthetic.secure_change(synthetic.Noise(), 0, task, _payload(model), layers,
                                     ("layer000.*",), "run1")
    assert change.size == 200 and set(layers.tensors) == {"layer000.weight"}


def test_bad_local_params_are_refused_by_name() -> None:
    with pytest.raises(personal.BadLocalParams, match="local_params"):
        personal.ask_of(json.dumps({local_params.HPARAM: 5}))
    with pytest.raises(personal.BadLocalParams, match="not JSON"):
        personal.ask_of("{")
