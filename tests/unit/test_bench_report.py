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
