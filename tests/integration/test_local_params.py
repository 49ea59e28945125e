"""Personalised layers (job key local_params) on a real aggregator and real nodes on loopback:
the local tensors' bytes never cross the wire in an update, the aggregator's model keeps its
own (starting) copy of them, each site keeps its own in its state directory, and secure
aggregation masks the shared tensors only.

Threat model: see tests/unit/test_local_params.py (the aggregator and anyone on the wire never
receive a site's local tensors; they do receive the shared ones, or their masked sum).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core import codec, local_params
from tests.fixtures.federation import Federation, job_dir, write_job

HEAD = ["fc2.*"]


def _start(tmp: Path) -> dict[str, np.ndarray]:
    """The digits model as the job's initial weights, its head set to a value training never
    keeps: a global head still equal to it was never aggregated."""
    from fedgpu.node.rounds import runner
    from fedgpu.node.rounds.workfiles import WEIGHTS_OUT

    runner.run_round(runner.parse_spec({
        "kind": "init", "task_name": "digits", "hyperparameters": {}, "seed": 0, "round": 0,
        "data_dir": None, "device": "cpu", "torch_threads": 1}), tmp)
    model = codec.read_file(tmp / WEIGHTS_OUT)
    model.update({k: np.full_like(v, 0.125) for k, v in model.items() if k.startswith("fc2.")})
    (tmp / "start.safetensors").write_bytes(codec.encode(model).to_bytes())
    return model


def _site_copies(node_state: Path) -> dict[str, dict[str, np.ndarray]]:
    found = sorted(node_state.glob("**/local-params/local-params-*.safetensors"))
    return {p.parent.parent.name: codec.read_file(p) for p in found}


@pytest.mark.timeout(240)
def test_local_head_never_travels_and_each_site_keeps_its_own(
        federation: Federation, digits_split: list[Path]) -> None:
    tmp = federation.tmp
    start = _start(tmp)
    job = write_job(tmp / "job.toml", rounds=2, min_nodes=2, round_deadline_s=60,
                    local_params=HEAD, initial_weights="start.safetensors")
    federation.start_server(job, "--state-dir", str(tmp / "state"))
    federation.start_node("site-a", digits_split[0])
    federation.start_node("site-b", digits_split[1])
    federation.wait_state(("finished",), timeout=200)
    rounds = [r for r in federation.query("ListRounds")["rounds"] if r["updates"]]
    assert [r["round"] for r in rounds] == [1, 2]
    shared = local_params.shared(start, HEAD)
    for r in rounds:
        # Bytes on the wire: each update is exactly the shared tensors' safetensors payload.
        one = len(codec.encode(shared, {"task": "digits", "round": str(r["round"])}).to_bytes())
        assert r["bytes_received"] == 2 * one, r
        # Round 2 trained on each site's own head, kept from round 1.
        assert [u["train_metrics"]["local_tensors"] for u in r["updates"]] == \
            [2.0 * (r["round"] - 1)] * 2
    # The aggregator never saw a head: its model still holds the starting one, and has learnt
    # the rest.
    final = codec.read_file(job_dir(tmp / "state") / "global.safetensors")
    for name in ("fc2.weight", "fc2.bias"):
        assert np.array_equal(final[name], start[name])
    assert not np.array_equal(final["fc1.weight"], start["fc1.weight"])
    assert federation.query("GetStatus")["rejections"] == {}
    # Each site keeps its own head in its state directory, trained on its own data.
    copies = _site_copies(tmp / "node-state")
    assert sorted(copies) == ["site-a", "site-b"], copies
    a, b = copies["site-a"], copies["site-b"]
    assert sorted(a) == sorted(b) == ["fc2.bias", "fc2.weight"]
    assert not np.array_equal(a["fc2.weight"], b["fc2.weight"])
    assert not np.array_equal(a["fc2.weight"], start["fc2.weight"])
    # The final evaluation scores each site with its own head: per-site accuracy, learnt.
    last = federation.query("ListRounds")["rounds"][-1]["eval"]
    assert sorted(e["node"] for e in last["per_node"]) == ["site-a", "site-b"]
    assert all(e["metrics"]["accuracy"] > 0.5 for e in last["per_node"]), last


@pytest.mark.timeout(120)
def test_a_pattern_matching_no_tensor_fails_the_job_by_name(federation: Federation) -> None:
    # With initial weights the check needs no node: the job fails before its first round.
    _start(federation.tmp)
    job = write_job(federation.tmp / "job.toml", rounds=1, min_nodes=1,
                    local_params=["fc2.*", "head.*"], initial_weights="start.safetensors")
    federation.start_server(job)
    doc = federation.wait_state(("failed",), timeout=100)
    text = json.dumps(doc)
    assert "'head.*' match no tensor" in text and "fc2.weight" in text, text[:2000]


@pytest.mark.timeout(240)
def test_secure_aggregation_masks_the_shared_tensors_only(
        federation: Federation, digits_split: list[Path]) -> None:
    tmp = federation.tmp
    start = _start(tmp)
    job = write_job(tmp / "job.toml", rounds=1, min_nodes=2, round_deadline_s=60,
                    evaluate=False, local_params=HEAD, initial_weights="start.safetensors",
                    secure_aggregation={"stage_timeout_s": 10})
    federation.start_server(job, "--state-dir", str(tmp / "state"))
    federation.start_node("site-a", digits_split[0], "--gpu", "none")
    federation.start_node("site-b", digits_split[1], "--gpu", "none")
    federation.wait_state(("finished",), timeout=200)
    # The unmasked mean is laid over the shared tensors: the head is the starting one still.
    final = codec.read_file(job_dir(tmp / "state") / "global.safetensors")
    assert np.array_equal(final["fc2.weight"], start["fc2.weight"])
    assert not np.array_equal(final["fc1.weight"], start["fc1.weight"])
    assert sorted(_site_copies(tmp / "node-state")) == ["site-a", "site-b"]
