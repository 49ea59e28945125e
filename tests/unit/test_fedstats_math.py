"""The combining math of federated statistics (fedgpu/core/fedstats/), pure: combined mean and
std against numpy on the concatenated data, quantiles within the stated error (one bin width),
suppression and noise as release.py states them, hostile documents refused.

Threat model (in full: docs/explanation/federated-statistics.md). The aggregator, and whoever
reads `job status`, learns per site: the column specs, which columns and cells it held back,
and for each column sent its record count, sum and sum of squares (so mean and std) and every
sent histogram cell, exactly without noise. Suppression (`min_count`, on the site) hides the
content of small cells and columns, not that they were small, and is no defence against
differencing two releases. Noise (Laplace/Gaussian, `epsilon` per site and job) gives
record-level differential privacy of the released numbers, not of the held-back pattern, and
is not accounted across jobs. Min and max are bin edges, never a record's value.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedgpu.core.fedstats import wire
from fedgpu.core.fedstats.columns import ColumnSpec, summarize
from fedgpu.core.fedstats.combine import QUANTILES, combine
from fedgpu.core.fedstats.release import Noise, ReleaseSettings, release

SPEC = ColumnSpec(name="x", lo=-10.0, hi=30.0, bins=40)


def _sites(rng: np.random.Generator) -> dict[str, np.ndarray]:
    # Unequal sizes and shifted distributions: a plain mean of site means would be wrong.
    return {"a": rng.normal(5, 3, 700), "b": rng.normal(12, 6, 1300), "c": rng.gamma(2, 2, 400)}


def _released(data: dict[str, np.ndarray], settings: ReleaseSettings, spec: ColumnSpec = SPEC):
    rng = np.random.default_rng(0)
    return {site: wire.loads(wire.dumps(release([summarize(spec, v)], settings, rng)))
            for site, v in data.items()}


def test_combined_mean_and_std_equal_numpy_on_the_concatenated_data() -> None:
    data = _sites(np.random.default_rng(1))
    out = combine(_released(data, ReleaseSettings(min_count=1)))
    allv = np.clip(np.concatenate(list(data.values())), SPEC.lo, SPEC.hi)
    col = out["combined"]["x"]
    assert col["count"] == allv.size
    assert col["mean"] == pytest.approx(allv.mean(), rel=1e-12, abs=1e-12)
    assert col["std"] == pytest.approx(allv.std(), rel=1e-10)
    for site, v in data.items():
        v = np.clip(v, SPEC.lo, SPEC.hi)
        assert out["sites"][site]["x"]["mean"] == pytest.approx(v.mean(), rel=1e-12)
        assert out["sites"][site]["x"]["std"] == pytest.approx(v.std(), rel=1e-10)


def test_mean_far_from_zero_keeps_its_precision() -> None:
    # The centre shift: values near 1e6 with std 0.1 lose nothing to cancellation.
    spec = ColumnSpec(name="x", lo=1e6 - 5, hi=1e6 + 5, bins=10)
    v = np.random.default_rng(2).normal(1e6, 0.1, 5000)
    col = combine(_released({"a": v[:2000], "b": v[2000:]}, ReleaseSettings(min_count=1),
                            spec))["combined"]["x"]
    assert col["std"] == pytest.approx(v.std(), rel=1e-6)


def test_combined_quantiles_within_one_bin_width_of_numpy() -> None:
    data = _sites(np.random.default_rng(3))
    col = combine(_released(data, ReleaseSettings(min_count=1)))["combined"]["x"]
    allv = np.clip(np.concatenate(list(data.values())), SPEC.lo, SPEC.hi)
    assert col["bin_width"] == SPEC.width == 1.0
    for q in QUANTILES:
        got = col["quantiles"][f"p{q * 100:g}"]
        assert abs(got - np.quantile(allv, q)) <= SPEC.width + 1e-9, q
    # The merged histogram is the histogram of the concatenated data; empty cells are held
    # back like small ones (release.py says why).
    expected = np.histogram(allv, bins=40, range=(-10, 30))[0].tolist()
    assert col["histogram"] == [c or None for c in expected]
    assert col["min"] == np.floor(allv.min()) and col["max"] == np.ceil(allv.max())


def test_cells_under_min_count_are_never_sent_and_the_combination_skips_them() -> None:
    spec = ColumnSpec(name="x", lo=0, hi=4, bins=4)
    # Site a: 50 values in cell 0, 3 in cell 3 (under min_count 5). Site b: 20 in cell 3.
    a = np.array([0.5] * 50 + [3.25, 3.5, 3.75])
    b = np.array([3.5] * 20)
    summaries = {s: [summarize(spec, v)] for s, v in (("a", a), ("b", b))}
    texts = {s: wire.dumps(release(v, ReleaseSettings(min_count=5), np.random.default_rng(0)))
             for s, v in summaries.items()}
    assert json.loads(texts["a"])["columns"][0]["histogram"] == [50.0, None, None, None]
    out = combine({s: wire.loads(t) for s, t in texts.items()})
    col = out["combined"]["x"]
    assert col["histogram"] == [50.0, None, None, 20.0]
    # Held back per cell, by site: a (1, 2, 3), b (0, 1, 2); empty cells count too.
    assert col["suppressed_cells"] == [1, 2, 2, 1]
    # Count, mean and std are aggregates over >= min_count records: the cell's values are in.
    assert col["count"] == 73
    assert col["mean"] == pytest.approx(np.concatenate([a, b]).mean())


def test_a_column_under_min_count_is_suppressed_whole() -> None:
    small = ReleaseSettings(min_count=10)
    out = combine(_released({"a": np.arange(9.0), "b": np.arange(30.0)}, small))
    assert out["sites"]["a"]["x"] == {"suppressed": True}
    col = out["combined"]["x"]
    assert col["sites"] == ["b"] and col["suppressed_sites"] == ["a"] and col["count"] == 30
    doc = json.loads(wire.dumps(release([summarize(SPEC, np.arange(9.0))], small,
                                        np.random.default_rng(0))))
    assert set(doc["columns"][0]) == {"name", "lo", "hi", "bins", "per_record", "suppressed"}


def test_min_count_counts_records_when_a_record_gives_several_values() -> None:
    spec = ColumnSpec(name="pixels", lo=0, hi=16, bins=4, per_record=64)
    # 9 images of 64 pixels (576 values) is under min_count 10 records (640 values).
    rel = release([summarize(spec, np.full((9, 64), 3.0))], ReleaseSettings(min_count=10),
                  np.random.default_rng(0))
    assert rel[0].suppressed
    rel = release([summarize(spec, np.full((10, 64), 3.0))], ReleaseSettings(min_count=10),
                  np.random.default_rng(0))
    assert not rel[0].suppressed and rel[0].histogram == (640.0, None, None, None)


def test_a_site_with_another_spec_is_left_out_with_the_reason() -> None:
    other = ColumnSpec(name="x", lo=0, hi=1, bins=40)
    sites = _released({"a": np.arange(20.0)}, ReleaseSettings(min_count=1))
    sites.update(_released({"b": np.zeros(20)}, ReleaseSettings(min_count=1), other))
    col = combine(sites)["combined"]["x"]
    assert col["sites"] == ["a"] and "spec differs" in col["excluded"]["b"]


@pytest.mark.parametrize("noise", [Noise.LAPLACE, Noise.GAUSSIAN])
def test_noise_has_the_stated_scale(noise: Noise) -> None:
    spec = ColumnSpec(name="x", lo=0, hi=2, bins=2, per_record=3)
    s = [summarize(spec, np.ones(3000))]
    settings = ReleaseSettings(min_count=1, noise=noise, epsilon=2.0, delta=1e-5)
    eps = 2.0 / 4  # one column, four releases
    rng = np.random.default_rng(4)
    counts = np.array([release(s, settings, rng)[0].count for _ in range(4000)]) - 3000
    sums = np.array([release(s, settings, rng)[0].shifted_sum for _ in range(4000)])
    if noise == Noise.LAPLACE:
        expected_count, expected_sum = np.sqrt(2) * 3 / eps, np.sqrt(2) * 3 * 1 / eps
    else:
        z = np.sqrt(2 * np.log(1.25 / 1e-5)) / eps
        expected_count, expected_sum = 3 * z, 3 * 1 * z
    assert counts.std() == pytest.approx(expected_count, rel=0.08)
    assert sums.std() == pytest.approx(expected_sum, rel=0.08)
    assert abs(counts.mean()) < 4 * expected_count / np.sqrt(4000)


def test_gaussian_refuses_an_epsilon_outside_its_bound() -> None:
    with pytest.raises(ValueError, match="epsilon < 1 per release"):
        release([summarize(SPEC, np.ones(10))],
                ReleaseSettings(noise=Noise.GAUSSIAN, epsilon=8.0), np.random.default_rng(0))


def test_noisy_histogram_cells_stay_non_negative() -> None:
    rel = release([summarize(SPEC, np.zeros(100))],
                  ReleaseSettings(min_count=1, noise=Noise.LAPLACE, epsilon=0.1),
                  np.random.default_rng(5))
    assert all(c is None or c >= 0 for c in rel[0].histogram)


def _doc(**col: object) -> str:
    base = {"name": "x", "lo": 0, "hi": 1, "bins": 2, "per_record": 1, "suppressed": False,
            "count": 4, "sum": 0.0, "sum_sq": 1.0, "histogram": [2, 2]}
    base.update(col)
    return json.dumps({"version": 1, "columns": [base]})


@pytest.mark.parametrize(("text", "match"), [
    (_doc(histogram=[2]), "histogram must list 2"),
    (_doc(histogram=[-1, 2]), "count >= 0"),
    (_doc(count=-3), ">= 0"),
    (_doc(sum="1"), "finite number"),
    (_doc(bins=True), "integer"),
    (_doc(bins=10**6), "bins must be"),
    (_doc(lo=1, hi=0), "lo < hi"),
    ('{"version": 1, "columns": [' + ",".join([_doc()[27:-2]] * 2) + "]}", "twice"),
    ('{"version": 2, "columns": []}', "version 1"),
    ("[]", "version 1"),
    ("not json", "not JSON"),
    ('{"version": 1, "columns": [' + ",".join(["{}"] * 300) + "]}", "at most 256"),
    (" " * (wire.MAX_DOC_BYTES + 1), "over"),
])
def test_a_bad_document_from_a_site_is_refused(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        wire.loads(text)


def test_nan_values_are_refused_on_the_site() -> None:
    with pytest.raises(ValueError, match="NaN"):
        summarize(SPEC, np.array([1.0, np.nan]))
