"""BENCHMARKS.md's throughput section (benchmarks/report.py) from a gpu_throughput document."""

from __future__ import annotations

import json
from typing import Any

from benchmarks.report import render
from tests.fixtures.federation import ROOT


def _results() -> dict[str, Any]:
    return json.loads((ROOT / "benchmarks" / "results.json").read_text())


def _tput() -> dict[str, Any]:
    rnd = {"round": 2, "steps": 40, "loop_images_per_s": 970.0, "round_images_per_s": 800.0,
           "overhead_s": 1.5, "first_step_s": 0.9}
    return {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0",
            "load_before": 0.5, "load_after": 0.7,
            "preset": {"depth": 18, "width": 64, "batch": 256, "amp": "bf16",
                       "channels_last": True, "threads": None, "seconds": 60},
            "plain": {"steps": 40, "images_per_s": 1000.0, "workers": 8,
                      "first_step_from_launch_s": 9.5, "first_step_loop_s": 1.25},
            "fedgpu": {"rounds": [rnd]}}


def test_the_throughput_section_shows_each_round_against_the_plain_loop() -> None:
    r = _results()
    r.pop("tput", None)
    assert "## 6." not in render(r)  # results of an older run render as before
    r["tput"] = _tput()
    text = render(r)
    assert "## 6. Training throughput" in text and "NVIDIA H100 80GB HBM3" in text
    assert "| plain PyTorch loop | 40 | 1000 | 100% | - | - | 9.50 from process start (1.25" \
        in text
    assert "| fedgpu round 2 | 40 | 970 | 97% | 800 (80% of plain) | 1.50 | 0.90 from" in text
    assert "load average before / after: 0.5 / 0.7" in text


def _many(impl: str, **extra: Any) -> dict[str, Any]:
    return {"impl": impl, "clients": 100, "per_round": 10, "rounds": 5, "cpus": 2,
            "load_before": 0.4, "load_after": 0.6, "wall_s": 30.0, "peak_rss_mib": 1300,
            "peak_pss_mib": 600, "processes_at_peak": 7, "accuracy": 0.5, **extra}


def test_the_many_clients_section_puts_both_frameworks_side_by_side() -> None:
    r = _results()
    r.pop("many", None)
    assert "## 7." not in render(r)
    big = _many("fedgpu", rounds=3, peak_rss_mib=7000, wall_s=20.0, rounds_finished=3,
                participants=[10, 10, 10], federated_accuracy_before_round_1=0.1,
                federated_accuracy_after=[0.2, 0.25, 0.3], queued_s_max=1.25)
    r["many"] = {"fedgpu": _many("fedgpu"), "flower": _many("flower", wall_s=40.0,
                                                            peak_rss_mib=1900),
                 "fedgpu_100x3": big, "flwr": "1.41.0", "ray": "2.55.1",
                 "machine": r["machine"]}
    text = render(r)
    assert "## 7. Many clients on one machine: fedgpu vs Flower's simulation" in text
    assert "| fedgpu | 30.0 | 1300 | 600 | 7 | 0.5 |" in text
    assert "| Flower simulation (Ray) | 40.0 | 1900 | 600 | 7 | 0.5 |" in text
    assert "`flwr` 1.41.0" in text and "Ray 2.55.1" in text
    # 7000 MiB is over the 6 GB target: said so, not hidden.
    assert "**7000 MiB** summed" in text and "(target < 6 GB: **missed**)" in text
    assert "before round 1 0.1, after round 3 0.3 (met: better)" in text


def test_results_measured_apart_are_copied_in_as_numbered_sections(tmp_path) -> None:
    from benchmarks.report import measured_apart

    (tmp_path / "DP.md").write_text(
        "# Privacy\n\ntext\n\n## Table\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "RING.md").write_text("# Ring\n\nmore\n")
    out = "\n".join(measured_apart(tmp_path, first=9))
    assert "## 9. Privacy" in out and "### Table" in out and "## 10. Ring" in out
    assert "# not a heading" in out and "## not a heading" not in out
    assert "(From `benchmarks/DP.md`.)" in out
