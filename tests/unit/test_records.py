"""The round history as records: `fedgpu rounds --json` and state.json stay exactly what the
aggregator wrote before the history became dataclasses.

tests/fixtures/state/*-v0.json are state.json files written by a real aggregator (a star run
with a failure and a refusal, and a ring run) before the split of server/rounds/engine.py: a run
resumed from them must serve the same documents, key for key and in the same order, and write
the same checkpoint state back.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedgpu.core.job import parse_job
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.records import RoundRecord
from fedgpu.server.rounds.ring import RingPlan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "state"


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def resumed(state: dict[str, Any]) -> Orchestrator:
    job = parse_job(state["job"])
    orch = Orchestrator(job, Registry(),
                        plan=RingPlan(job) if state.get("mode") == "ring" else None)
    orch.restore({"w": np.zeros(2, np.float32)}, copy.deepcopy(state))
    return orch


@pytest.mark.parametrize("name", ["star-v0.json", "ring-v0.json"])
def test_old_state_resumes_into_the_same_documents(name: str) -> None:
    state = load(name)
    orch = resumed(state)
    expected = {"run_id": state["run_id"], "initial_eval": state["initial_eval"],
                "rounds": state["history"]}
    # Strings, not dicts: key order is part of what a reader of the document sees.
    assert json.dumps(orch.rounds_doc()) == json.dumps(expected)
    written = {k: v for k, v in state.items() if k not in (
        "weights_file", "weights_sha256", "weights_digest", "weights_digest_algorithm")}
    again = orch.checkpoint_state()
    # The job is this version's parse of the old one: the same keys, plus new ones at their
    # defaults (a newer job key must not change what an old run does).
    new_keys = {k: v for k, v in again["job"].items() if k not in state["job"]}
    # [resources] says what the old use_gpu said.
    gpu = "preferred" if state["job"]["use_gpu"] else "none"
    assert new_keys == {"max_examples_per_node": None, "name": None, "task_dir": None,
                        "wire_dtype": None, "resources": {"gpu": gpu, "min_gpu_free_mib": 0,
                                                          "gpu_memory_mib": None, "workers": 1,
                                                          "min_workers": None},
                        "privacy": None, "secure_aggregation": None,
                        "queue_timeout_s": 600.0, "model_from_job": None,
                        "local_params": (), "study": None, "statistics": None,
                        "transfer": {"slow_sites": "skip"}}
    again["job"] = {k: v for k, v in again["job"].items() if k in state["job"]}
    assert json.dumps(again) == json.dumps(written)
    assert orch.global_round == state["global_round"] and orch.completed


def test_fixtures_cover_what_the_records_hold() -> None:
    star, ring = load("star-v0.json"), load("ring-v0.json")
    assert star["rejections"] == {"digest": 1}
    rounds = star["history"]
    assert any(r["failures"] for r in rounds) and any(r["rejected"] for r in rounds)
    assert all(r["eval"]["per_node"] for r in rounds) and star["initial_eval"]["per_node"]
    assert all("ring" in r and r["updates"][0]["iteration_loss"] for r in ring["history"])
    assert ring["mode"] == "ring" and "mode" not in star


def test_unknown_keys_are_kept_and_missing_ones_get_defaults() -> None:
    rec = load("star-v0.json")["history"][0]
    newer = {**rec, "future_key": {"x": 1}}
    newer["updates"] = [{**rec["updates"][0], "future_update_key": 2}]
    assert RoundRecord.from_dict(newer).to_dict() == newer
    assert list(RoundRecord.from_dict(newer).to_dict())[-1] == "future_key"
    older = {k: v for k, v in rec.items() if k not in ("aggregation_s", "bytes_received")}
    back = RoundRecord.from_dict(older).to_dict()
    assert back["aggregation_s"] == 0.0 and back["bytes_received"] == 0
    assert {k: v for k, v in back.items() if k in older} == older


def test_queued_seconds_is_reported_when_nodes_send_it_and_absent_from_older_records() -> None:
    from fedgpu.proto import pb
    from fedgpu.server.rounds.records import Resources

    new = Resources.from_wire(pb.RoundResources(device="cpu", round_seconds=2.5,
                                                queued_seconds=1.23456))
    assert new.to_dict()["queued_seconds"] == 1.235
    assert list(new.to_dict())[-3:] == ["round_seconds", "queued_seconds", "device_seconds"]
    old = Resources.from_dict({"device": "cpu", "round_seconds": 2.5})
    assert "queued_seconds" not in old.to_dict()
    assert Resources.from_dict(new.to_dict()) == new
