"""The job file's secure aggregation: `secure_aggregation = true` or `[secure_aggregation]`,
the defaults, every bad value named, and the jobs it cannot serve refused with the reason."""

from __future__ import annotations

import tomllib

import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.core.secagg.jobfile import JobSecAgg
from fedgpu.core.secagg.params import Settings


def _job(text: str):  # noqa: ANN202
    return parse_job(tomllib.loads('task = "digits"\nmin_nodes = 2\n' + text), "job.toml")


def test_off_by_default_and_true_gives_the_defaults() -> None:
    assert _job("").secure_aggregation is None
    assert _job("secure_aggregation = false").secure_aggregation is None
    assert _job("secure_aggregation = true").secure_aggregation == JobSecAgg()


def test_table_sets_everything() -> None:
    job = _job("""
[secure_aggregation]
threshold = 3
neighbours = 4
clip = 2
bits = 16
ring_bits = 32
max_weight = 1000
stochastic = false
stage_timeout_s = 5
""")
    assert job.secure_aggregation == JobSecAgg(
        Settings(threshold=3, neighbours=4, clip=2.0, bits=16, ring_bits=32, max_weight=1000,
                 stochastic=False), 5.0)
    assert _job('[secure_aggregation]\nneighbours = "all"').secure_aggregation == JobSecAgg()
    assert _job("[secure_aggregation]\nenabled = false").secure_aggregation is None


def test_the_stored_form_reads_back() -> None:
    job = _job("[secure_aggregation]\nneighbours = 6\nclip = 0.5")
    again = parse_job(job.to_dict(), "stored")
    assert again.secure_aggregation == job.secure_aggregation


@pytest.mark.parametrize(("text", "message"), [
    ('secure_aggregation = "yes"', "must be true, false or a table"),
    ("[secure_aggregation]\nthreshhold = 2", "unknown key.*threshhold"),
    ("[secure_aggregation]\nthreshold = 1", "threshold must be a fraction"),
    ("[secure_aggregation]\nthreshold = 1.5", "threshold must be a fraction"),
    ('[secure_aggregation]\nneighbours = "some"', "neighbours' must be"),
    ("[secure_aggregation]\nneighbours = 0", "neighbours must be"),
    ("[secure_aggregation]\nclip = -1", "clip must be a positive"),
    ("[secure_aggregation]\nbits = true", "bits' must be an integer"),
    ("[secure_aggregation]\nring_bits = 16", "ring_bits must be 32, 64 or \"auto\""),
    ("[secure_aggregation]\nring_bits = \"big\"", "ring_bits' must be 32, 64 or"),
    ("[secure_aggregation]\nbits = 40\nring_bits = 32", "bits must be between"),
    ("[secure_aggregation]\nstage_timeout_s = 0", "stage_timeout_s' must be a positive"),
    ('[secure_aggregation]\nstochastic = "no"', "stochastic' must be true or false"),
])
def test_bad_values_are_named(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _job(text)


@pytest.mark.parametrize("strategy", ["median", "trimmed_mean"])
def test_strategies_needing_single_updates_are_refused_with_the_reason(strategy: str) -> None:
    with pytest.raises(ConfigError, match=f"strategy '{strategy}' cannot run with "
                       "secure_aggregation: .*only reveals their sum"):
        _job(f'strategy = "{strategy}"\nsecure_aggregation = true')


@pytest.mark.parametrize("strategy", ["fedavg", "fedavgm", "fedadam"])
def test_mean_strategies_are_fine(strategy: str) -> None:
    assert _job(f'strategy = "{strategy}"\nsecure_aggregation = true').secure_aggregation


def test_ring_mode_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="star mode only.*no sum to protect"):
        parse_job(tomllib.loads('task = "digits"\nmode = "ring"\nmin_nodes = 3\n'
                                'secure_aggregation = true'), "job.toml")


def test_one_site_is_refused() -> None:
    with pytest.raises(ConfigError, match="min_nodes >= 2 .*got 1"):
        parse_job({"task": "digits", "secure_aggregation": True}, "job.toml")


def test_the_compose_example_job_is_secure() -> None:
    from pathlib import Path

    from fedgpu.core.job import load_job

    job = load_job(Path(__file__).resolve().parents[2] / "compose" / "job-secure.toml")
    assert job.secure_aggregation is not None and job.min_nodes == 3
    assert job.secure_aggregation.settings.neighbours is None



@pytest.mark.parametrize(("table", "why"), [
    # A fraction below one half: a round's threshold could be a minority of shareholders.
    ("threshold = 0.3", "threshold 0.3 would let a round run with fewer than a strict "
                        "majority"),
    # 2 of 4 shareholders (3 neighbours rounded up to 4 for odd rounds: 5) is no majority.
    ("threshold = 2\nneighbours = 3", "threshold 2 is not a strict majority of the 5 "
                                      "shareholders"),
    # Every site a neighbour, min_nodes 5: 2 of 5.
    ("threshold = 2", "threshold 2 is not a strict majority of the 5 shareholders"),
])
def test_submit_refuses_a_threshold_that_is_no_strict_majority(table: str, why: str) -> None:
    def job(table: str):  # noqa: ANN202
        text = f'task = "digits"\nmin_nodes = 5\n[secure_aggregation]\n{table}\n'
        return parse_job(tomllib.loads(text), "job.toml")

    with pytest.raises(ConfigError, match=rf"\[secure_aggregation\] {why}"):
        job(table)
    # A strict majority is accepted.
    job("threshold = 3")
    job("threshold = 0.5")
