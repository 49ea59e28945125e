"""Simulated nodes on the real wire: a 100-node pool, 10 sampled per round, every strategy path."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest

from tests.fixtures.federation import Federation, write_job

# A 100-node simulated pool through several rounds of every strategy path.
pytestmark = pytest.mark.slow


def _run(federation: Federation, tmp_path: Path, nodes: int, per_process: int, **job: object
         ) -> tuple[dict, dict, list[dict]]:
    path = write_job(tmp_path / "job.toml", task="synthetic", hyperparameters={}, **job)
    # Not --exit-when-done: the run can end within a second of the last registration, and the
    # test must still be able to ask for its final state; the server is stopped below instead.
    server = federation.start_server(path, "--heartbeat-s", "2")
    sims = []
    for i, start in enumerate(range(0, nodes, per_process)):
        stats = tmp_path / f"sim-{i}.json"
        sims.append((federation.spawn(f"sim-{i}", [
            "sim", "--aggregator", federation.address, "--nodes", str(per_process),
            "--start-index", str(start), "--params", "20000", "--tensors", "5",
            "--poll-s", "5", "--stats", str(stats)]), stats))
    status = federation.wait_state(("finished", "failed"), timeout=120)
    rounds = federation.query("ListRounds")
    # The federation stays up after its job: the simulated nodes stop when told to.
    for proc, _ in sims:
        proc.popen.send_signal(signal.SIGTERM)
    for proc, _ in sims:
        assert proc.popen.wait(timeout=60) == 0, proc.text()[-3000:]
    server.popen.send_signal(signal.SIGTERM)
    assert server.popen.wait(timeout=30) == 0, server.text()[-3000:]
    return status, rounds, [json.loads(s.read_text()) for _, s in sims]


def test_hundred_nodes_ten_per_round(federation: Federation, tmp_path: Path) -> None:
    status, rounds, stats = _run(
        federation, tmp_path, nodes=100, per_process=50, rounds=5, min_nodes=10,
        min_available_nodes=100, fraction=0.1, evaluate=False, seed=3, strategy="fedavgm")
    assert status["state"] == "finished", status
    assert status["nodes"]["registered"] == 100
    assert sum(s["registered"] for s in stats) == 100
    assert not [e for s in stats for e in s["errors"]]
    picked = [r["participants"] for r in rounds["rounds"]]
    assert [r["status"] for r in rounds["rounds"]] == ["finished"] * 5
    assert all(len(p) == 10 and len(set(p)) == 10 for p in picked)
    assert all(r["nodes_reporting"] == 10 for r in rounds["rounds"])
    # Sampled over the whole pool, and a new sample each round.
    names = Counter(n.rsplit("-", 1)[0] for p in picked for n in p)
    assert len(names) > 30
    assert len({tuple(sorted(n.rsplit("-", 1)[0] for n in p)) for p in picked}) == 5
    # 5 rounds x 10 train tasks plus one init, answered by simulated nodes.
    assert sum(s["tasks"].get("train", 0) for s in stats) == 50


@pytest.mark.parametrize("strategy", ["median", "fedadam"])
def test_strategies_over_the_wire(federation: Federation, tmp_path: Path, strategy: str) -> None:
    status, rounds, _ = _run(federation, tmp_path, nodes=8, per_process=8, rounds=2,
                             min_nodes=5, min_available_nodes=8, fraction=0.6, evaluate=True,
                             strategy=strategy)
    assert status["state"] == "finished" and status["strategy"] == strategy
    assert [len(r["participants"]) for r in rounds["rounds"]] == [5, 5]
    assert rounds["rounds"][-1]["eval"]["nodes"] == 8
