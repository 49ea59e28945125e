"""A state directory written before the round history became records resumes: a real
aggregator reads tests/fixtures/state/star-v0.json (written by the aggregator before
server/rounds/engine.py was split), serves its rounds unchanged, and trains on from them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fedgpu.core import codec
from tests.fixtures.federation import Federation, write_job

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "state" / "star-v0.json"


def digits_weights(hparams: dict) -> bytes:
    from fedgpu.node import weights
    from fedgpu.node.tasks import load_task

    model = load_task("digits").build_model(hparams)
    return codec.encode(dict(weights.state_arrays(model))).to_bytes()


def test_old_state_dir_resumes_and_trains_on(federation: Federation, tmp_path: Path,
                                             digits_split: list[Path]) -> None:
    old = json.loads(FIXTURE.read_text())
    job = old["job"]
    # The fixture's run had completed its 2 rounds; as if it had been stopped after round 2
    # of 3, the job asks for one more and the state says it is not done yet.
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    blob = digits_weights(job["hyperparameters"])
    (state_dir / "global-000002.safetensors").write_bytes(blob)
    state = {**old, "completed": False, "weights_file": "global-000002.safetensors",
             "weights_sha256": hashlib.sha256(blob).hexdigest()}
    (state_dir / "state.json").write_text(json.dumps(state))
    job_file = write_job(tmp_path / "job.toml", rounds=3, min_nodes=2, evaluate=False,
                         min_available_nodes=None, hyperparameters=job["hyperparameters"])

    server = federation.start_server(job_file, "--state-dir", str(state_dir))
    assert f"resumed run {old['run_id']} after round 2 of 3" in server.text()
    served = federation.query("ListRounds")
    assert json.dumps(served["rounds"]) == json.dumps(old["history"])
    assert served["initial_eval"] == old["initial_eval"]
    assert federation.query("GetStatus")["rejections"] == old["rejections"]

    for i, data in enumerate(digits_split[:2], start=1):
        federation.start_node(f"site-{i}", data, "--gpu", "none")
    status = federation.wait_state(("finished", "failed"), timeout=240)
    assert status["state"] == "finished", status["error"]
    rounds = federation.query("ListRounds")["rounds"]
    assert json.dumps(rounds[0]) == json.dumps(old["history"][0])
    # Round 3's nodes scored round 2's model first: their evaluations join round 2's.
    second, old_second = rounds[1], old["history"][1]
    assert {k: v for k, v in second.items() if k != "eval"} == {
        k: v for k, v in old_second.items() if k != "eval"}
    per_node = second["eval"]["per_node"]
    assert per_node[:2] == old_second["eval"]["per_node"]
    assert sorted(e["node"] for e in per_node[2:]) == ["site-1", "site-2"]
    assert second["eval"]["nodes"] == 4
    assert rounds[2]["round"] == 3 and rounds[2]["status"] == "finished"
    assert sorted(u["node"] for u in rounds[2]["updates"]) == ["site-1", "site-2"]
    # The old run became the aggregator's first job, its checkpoint moved into the job's
    # directory; the job file given at start was not queued a second time.
    (job_row,) = federation.query("ListJobs")
    assert job_row["state"] == "finished" and job_row["rounds_done"] == 3
    saved = json.loads((state_dir / "jobs" / job_row["job_id"] / "state.json").read_text())
    assert not (state_dir / "state.json").exists()
    # The history is stored once, in the job database (served above); the checkpoint that
    # replaced the old one holds the weights' state only.
    assert saved["global_round"] == 3 and "history" not in saved
