"""Slow links (issue 37.4): the node's smoothed rates, the aggregator's round-trip estimate
and its decision per site (fedgpu/core/link_rates.py), and the job's [transfer] key."""

from __future__ import annotations

import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.core.link_rates import (
    MAX_AGE_S,
    MIN_MEASURED_BYTES,
    LinkMeter,
    SiteLink,
    SlowSites,
    compressed_bytes,
    estimate,
    mbit,
    plan,
)
from fedgpu.core.update_codecs import UpdateCodec

MB = 1_000_000
# 2.1 Mbit/s, the issue's slow site.
SLOW = 2.1e6 / 8


def test_estimate_adds_download_upload_and_training() -> None:
    assert estimate(64 * MB, 64 * MB, 8 * MB, 4 * MB, 3.0) == pytest.approx(8 + 16 + 3)
    assert estimate(10 * MB, 0, 10 * MB, 1.0) == pytest.approx(1.0)


def test_meter_smooths_and_ignores_small_transfers() -> None:
    m = LinkMeter()
    assert m.saw("down", MIN_MEASURED_BYTES - 1, 0.001) is None and m.down == 0
    assert m.saw("down", 4 * MB, 2.0) == pytest.approx(2 * MB)
    assert m.down == pytest.approx(2 * MB)  # the first figure is taken as it is
    m.saw("down", 4 * MB, 1.0)
    assert 2 * MB < m.down < 4 * MB  # smoothed toward the newer one
    assert m.saw("up", 4 * MB, 0.0) is None and m.up == 0


def test_site_link_ignores_nonsense_and_ages() -> None:
    link = SiteLink()
    link.report(float("nan"), -5.0, now=100.0)
    assert not link.known(100.0) and link.at == 0
    link.report(SLOW, 0.0, now=100.0)
    # One way measured: the other is taken to be as fast.
    assert link.known(100.0) and link.rates() == (SLOW, SLOW)
    assert link.known(100.0 + MAX_AGE_S) and not link.known(101.0 + MAX_AGE_S)


def test_the_issues_slow_site_is_skipped_with_rate_and_deadline() -> None:
    link = SiteLink(SLOW, SLOW, at=1000.0)
    # 23.6 MB down and back at 2.1 Mbit/s: ~180 s for a 15 s deadline.
    verdict = plan(link, 23_600_000, 23_600_000, 15.0, SlowSites.SKIP, now=1000.0)
    assert not verdict.admit
    assert verdict.reason == "needs ~180 s at 2.1 Mbit/s, deadline 15 s"


def test_fast_unknown_stale_and_try_are_admitted_as_they_are() -> None:
    fast = SiteLink(100 * MB, 100 * MB, at=0.0)
    assert plan(fast, 64 * MB, 64 * MB, 15.0, SlowSites.SKIP, now=0.0).admit
    slow = SiteLink(SLOW, SLOW, at=0.0)
    assert plan(SiteLink(), 64 * MB, 64 * MB, 15.0, SlowSites.SKIP, now=0.0).admit
    assert plan(slow, 64 * MB, 64 * MB, 15.0, SlowSites.SKIP, now=MAX_AGE_S + 1).admit
    tried = plan(slow, 64 * MB, 64 * MB, 15.0, SlowSites.TRY, now=0.0)
    assert tried.admit and tried.codec is None


def test_training_time_counts() -> None:
    link = SiteLink(10 * MB, 10 * MB, at=0.0)
    assert plan(link, 10 * MB, 10 * MB, 10.0, SlowSites.SKIP, now=0.0).admit
    link.train_s = 8.0
    assert not plan(link, 10 * MB, 10 * MB, 10.0, SlowSites.SKIP, now=0.0).admit


def test_compress_sizes_the_update_to_the_deadline() -> None:
    # Download 1 s, then 10 MB of update at 1 MB/s in 8 s: int8 (~2.6 MB) fits.
    link = SiteLink(10 * MB, 1 * MB, at=0.0)
    v = plan(link, 10 * MB, 10 * MB, 10.0, SlowSites.COMPRESS, now=0.0)
    assert v.admit and v.codec is UpdateCodec.INT8 and "int8" in v.reason
    # 100 MB: int8 (~26 MB) does not fit in ~8 s; top-k of a share that does.
    v = plan(SiteLink(100 * MB, 1 * MB, at=0.0), 100 * MB, 100 * MB, 10.0,
             SlowSites.COMPRESS, now=0.0)
    assert v.admit and v.codec is UpdateCodec.TOPK and 0 < v.topk_fraction < 0.25
    sent = compressed_bytes(100 * MB, UpdateCodec.TOPK, v.topk_fraction)
    assert 100 * MB / (100 * MB) + sent / MB <= 10.0 * 0.9 + 1e-9
    # A download alone past the deadline: no codec helps.
    v = plan(SiteLink(1 * MB, 1 * MB, at=0.0), 100 * MB, 100 * MB, 10.0,
             SlowSites.COMPRESS, now=0.0)
    assert not v.admit and "even a compressed update" in v.reason


def test_mbit() -> None:
    assert mbit(SLOW) == "2.1 Mbit/s" and mbit(1000) == "8 kbit/s"
    assert mbit(2.5e9 / 8) == "2.5 Gbit/s"


def test_transfer_section_parses_and_refuses_by_name() -> None:
    job = parse_job({"task": "digits"})
    assert job.transfer.mode is SlowSites.SKIP
    assert parse_job(job.to_dict()) == job
    job = parse_job({"task": "digits", "transfer": {"slow_sites": "compress"}})
    assert job.transfer.mode is SlowSites.COMPRESS and parse_job(job.to_dict()) == job
    with pytest.raises(ConfigError, match="slow_sites' must be one of skip, compress, try"):
        parse_job({"task": "digits", "transfer": {"slow_sites": "fast"}})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) in \[transfer\]"):
        parse_job({"task": "digits", "transfer": {"slow": "skip"}})
    with pytest.raises(ConfigError, match="secure_aggregation: SecAgg"):
        parse_job({"task": "digits", "min_nodes": 3, "secure_aggregation": True,
                   "transfer": {"slow_sites": "compress"}})
    with pytest.raises(ConfigError, match="clips and noises whole updates"):
        parse_job({"task": "digits", "privacy": {"mode": "central", "clip_norm": 1.0,
                                                    "noise_multiplier": 0.5},
                   "transfer": {"slow_sites": "compress"}})
    with pytest.raises(ConfigError, match="is for star jobs"):
        parse_job({"task": "digits", "mode": "async",
                   "transfer": {"slow_sites": "compress"}})
