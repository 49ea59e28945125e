"""Simulated nodes (`fedgpu sim`) answer every kind of task a real node does, through a real
aggregator on loopback and `fedgpu job submit`: a training job with `local_params` (the local
tensors' bytes never cross the wire, and the aggregator's copy of them is never updated), an
evaluate job scoring that job's model (`model_from_job`), and a statistics job whose releases
are held back under min_count on the node (node/statistics_release.py, the agent's own code).

Threat model of local_params: tests/unit/test_local_params.py; of the statistics release:
docs/explanation/federated-statistics.md. A simulated node keeps its local tensors in memory
(node/sim/personal.py): what it sends is what a real site sends.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core import codec, local_params
from fedgpu.node.sim import statistics as sim_statistics
from fedgpu.node.sim import synthetic
from tests.fixtures.federation import OPERATOR_TOKEN, Federation, cli, write_job
from tests.integration.test_jobs import job_cli, wait_job
from tests.integration.test_sim_lifecycle import _wait_alive

ENDED = ("finished", "failed", "stopped")
NODES = 3
PARAMS, TENSORS = 600, 3
LOCAL = ["layer002.*"]


@pytest.mark.timeout(180)
def test_simulated_nodes_train_with_local_params_evaluate_and_release_statistics(
        federation: Federation, tmp_path: Path) -> None:
    fed = federation
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1")
    stats = tmp_path / "sim.json"
    sim = fed.spawn("sim", ["sim", "--aggregator", fed.address, "--nodes", str(NODES),
                            "--poll-s", "2", "--params", str(PARAMS), "--tensors", str(TENSORS),
                            "--stats", str(stats)])
    _wait_alive(fed, {f"sim-{i:05d}" for i in range(NODES)})

    # The model to start from, uploaded with the job: its local tensor must come back as is.
    start = synthetic.synthetic_model(PARAMS, TENSORS, seed=7)
    (tmp_path / "start.safetensors").write_bytes(codec.encode(start).to_bytes())
    train = job_cli(fed, "submit", str(write_job(
        tmp_path / "train.toml", task="synthetic", hyperparameters={}, rounds=2,
        min_nodes=NODES, round_deadline_s=30, evaluate=False, local_params=LOCAL,
        initial_weights="start.safetensors")))
    done = wait_job(fed, train["job_id"], ENDED, timeout=90)
    assert done["state"] == "finished", done
    model = tmp_path / "trained.safetensors"
    r = cli("job", "model", train["job_id"], "--out", str(model), "--address", fed.address,
            operator_token=OPERATOR_TOKEN)
    assert r.returncode == 0, r.stderr
    final = codec.read_file(model)
    # The aggregator's local tensor is still the initial model's: no site ever sent its
    # own; the shared ones moved.
    assert sorted(final) == sorted(start)
    shared, local = local_params.split(start, LOCAL)
    assert local and shared
    for name in local:
        np.testing.assert_array_equal(final[name], start[name])
    for name in shared:
        assert not np.array_equal(final[name], start[name]), name

    evaluated = job_cli(fed, "submit", str(_job(tmp_path / "eval.toml", mode="evaluate",
                                                model_from_job=train["job_id"])))
    # min_count 3: sites of 10-12 records send both columns, with some cells held back.
    counted = job_cli(fed, "submit", str(_job(tmp_path / "stats.toml", mode="statistics",
                                              tables={"statistics": {"min_count": 3}})))
    doc = wait_job(fed, evaluated["job_id"], ENDED, timeout=60)
    assert doc["state"] == "finished", doc
    ev = doc["evaluation"]
    assert sorted(e["node"] for e in ev["per_node"]) == [f"sim-{i:05d}" for i in range(NODES)]
    assert all(e["metrics"]["accuracy"] > 0 for e in ev["per_node"]), ev
    doc = wait_job(fed, counted["job_id"], ENDED, timeout=60)
    assert doc["state"] == "finished", doc
    released = doc["statistics"]
    assert released["release"]["min_count"] == 3
    assert sorted(released["sites"]) == [f"sim-{i:05d}" for i in range(NODES)]
    for i in range(NODES):
        records = 10 + i  # a simulated node's record count (node/sim/node.py)
        cols = dict(sim_statistics.columns(i, records))
        site = released["sites"][f"sim-{i:05d}"]
        assert site["label"]["count"] == records
        assert site["label"]["mean"] == pytest.approx(cols[sim_statistics.LABEL].mean())
        # Cells under min_count records (3 labels; 3 x 4 feature values) never left the node.
        for spec, threshold in ((sim_statistics.LABEL, 3), (sim_statistics.FEATURE, 12)):
            hist, _ = np.histogram(cols[spec], bins=spec.bins, range=(spec.lo, spec.hi))
            assert site[spec.name]["histogram"] == [
                float(c) if c >= threshold else None for c in hist], spec.name
    assert released["combined"]["label"]["count"] == sum(10 + i for i in range(NODES))
    held = [c for site in released["sites"].values() for col in site.values()
            for c in col["histogram"] if c is None]
    assert held, "the sites' small cells should have been held back"

    sim.popen.send_signal(signal.SIGTERM)
    assert sim.popen.wait(timeout=60) == 0, sim.text()[-3000:]
    sent = json.loads(stats.read_text())
    assert sent["errors"] == [], sent
    assert sent["tasks"] == {"train": 2 * NODES, "evaluate": NODES,
                             "statistics": NODES}, sent["tasks"]
    # Bytes on the wire: every training update is the shared tensors' payload, nothing more.
    one = len(codec.encode(shared).to_bytes())
    assert [p["bytes"] for p in sent["pushes"]] == [one] * 2 * NODES, (sent["pushes"], one)


def _job(path: Path, tables: dict[str, dict[str, object]] | None = None, **keys: object
         ) -> Path:
    # No training keys: write_job's defaults (rounds, fraction) are refused in these modes.
    lines = ['task = "synthetic"', f"min_nodes = {NODES}", "use_gpu = false",
             "round_deadline_s = 30", *(f"{k} = {json.dumps(v)}" for k, v in keys.items())]
    for name, table in (tables or {}).items():
        lines += [f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in table.items())]
    path.write_text("\n".join(lines) + "\n")
    return path
