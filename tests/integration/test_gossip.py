"""The gossip exchange on real gloo processes: W x as numpy computes it, and a dead rank named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from fedgpu.core.mixing import uniform_ring
from tests.fixtures.federation import ROOT, base_env, free_port
from tests.fixtures.gossip_world import vector


def run_world(tmp: Path, world: int, scenario: str, timeout: float = 120) -> list[int]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.fixtures.gossip_world", str(r),
                               str(world), str(port), str(tmp), scenario],
                              cwd=ROOT, env=base_env(OMP_NUM_THREADS="1"))
             for r in range(world)]
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_mixing_step_equals_w_times_x(tmp_path: Path) -> None:
    custom = np.array([[0.5, 0.5, 0.0, 0.0],
                       [0.25, 0.25, 0.5, 0.0],
                       [0.0, 0.25, 0.25, 0.5],
                       [0.25, 0.0, 0.25, 0.5]])  # doubly stochastic, not symmetric
    topologies = {f"ring{n}": uniform_ring(n) for n in (2, 3, 4, 5)}
    topologies |= {"custom4": custom, "identity3": np.eye(3), "single1": uniform_ring(1)}
    (tmp_path / "topologies.json").write_text(
        json.dumps({k: v.tolist() for k, v in topologies.items()}))
    assert run_world(tmp_path, 5, "mix") == [0] * 5
    for name, w in topologies.items():
        n = len(w)
        x = np.stack([vector(r) for r in range(n)]).astype(np.float64)
        expected = w @ x
        got = np.stack([np.load(tmp_path / f"{name}-{r}.npy") for r in range(n)])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=name)
        # Doubly stochastic: the average of the copies is what it was before the exchange.
        np.testing.assert_allclose(got.mean(0), x.mean(0), rtol=1e-5, atol=1e-5)
    # N=2: left and right are the same peer, whose copy then counts 2/3.
    x0, x1 = vector(0).astype(np.float64), vector(1).astype(np.float64)
    np.testing.assert_allclose(np.load(tmp_path / "ring2-0.npy"), x0 / 3 + 2 * x1 / 3,
                               rtol=1e-5, atol=1e-5)
    # The identity exchanges nothing and changes nothing.
    np.testing.assert_allclose(np.load(tmp_path / "identity3-1.npy"), vector(1))


def test_dead_rank_is_named_by_every_survivor(tmp_path: Path) -> None:
    codes = run_world(tmp_path, 4, "die")
    assert codes[2] == 17
    for rank in (0, 1, 3):
        assert codes[rank] == 1, f"rank {rank} did not stop with an error"
        lost, message = (tmp_path / f"dead-{rank}.txt").read_text().split("\n", 1)
        assert lost == "[2]", f"rank {rank} blamed {lost}: {message}"
        assert "ring lost rank 2 (node-3)" in message


def test_a_survivor_judging_late_still_finds_the_store(tmp_path: Path) -> None:
    # Rank 0 hosts the rendezvous store and sees the death first; rank 1 is still computing.
    # If rank 0 left at once, rank 1 would find no store and blame rank 0.
    codes = run_world(tmp_path, 3, "die-late")
    assert codes == [1, 1, 17]
    for rank in (0, 1):
        lost, message = (tmp_path / f"dead-{rank}.txt").read_text().split("\n", 1)
        assert lost == "[2]", f"rank {rank} blamed {lost}: {message}"
        assert "ring lost rank 2 (node-3)" in message
