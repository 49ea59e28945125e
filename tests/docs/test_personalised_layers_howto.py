"""docs/how-to/personalised-layers.md runs as written: a job with local_params on two local
nodes over a label-skewed split, each site's accuracy with its own head, and each site's copy
of the head in its node's state directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedgpu.core import codec
from tests.fixtures.doc_blocks import ROOT, run_page


@pytest.mark.timeout(420)
def test_personalised_layers_how_to_runs_as_written(tmp_path: Path) -> None:
    results = run_page(ROOT / "docs" / "how-to" / "personalised-layers.md", tmp_path)
    printed = results[2].output
    assert "node-1 accuracy" in printed and "node-2 accuracy" in printed, printed
    run = tmp_path / "checkout" / "runs"
    heads = sorted(run.glob("logs/node-state/identity/named/*/local-params/*.safetensors"))
    assert len(heads) == 2, heads
    a, b = (codec.read_file(p) for p in heads)
    assert sorted(a) == ["fc2.bias", "fc2.weight"]
    assert (a["fc2.weight"] != b["fc2.weight"]).any()  # each site trained its own
