"""Mixing matrices and ring-mode job keys: the numpy reference and the validation messages."""

from __future__ import annotations

import numpy as np
import pytest

from fedgpu.core import mixing
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.server.rounds.ring import RingAverage, block_range, peer_host
from fedgpu.server.strategies.update import UpdateIn


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_uniform_ring_is_doubly_stochastic_with_three_neighbours(n: int) -> None:
    w = mixing.uniform_ring(n)
    np.testing.assert_allclose(w.sum(0), 1.0)
    np.testing.assert_allclose(w.sum(1), 1.0)
    assert mixing.check(w.tolist(), n).shape == (n, n)
    for r in range(n):
        send, recv = mixing.peers(w, r)
        assert sorted(send) == sorted(recv) == sorted({(r - 1) % n, (r + 1) % n} - {r})


def test_two_nodes_left_is_right() -> None:
    np.testing.assert_allclose(mixing.uniform_ring(2), [[1 / 3, 2 / 3], [2 / 3, 1 / 3]])


@pytest.mark.parametrize("w", [mixing.uniform_ring(5), np.eye(3),
                               np.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]])])
def test_combine_is_a_row_of_w_times_x(w: np.ndarray) -> None:
    n = len(w)
    x = np.random.default_rng(0).standard_normal((n, 7))
    for r in range(n):
        send, recv = mixing.peers(w, r)
        got = mixing.combine(w, r, x[r], {j: x[j] for j in recv})
        np.testing.assert_allclose(got, (w @ x)[r])
        # We send to whoever weights us: column r of W.
        assert send == [j for j in range(n) if j != r and w[j, r] > 0]


@pytest.mark.parametrize(("matrix", "message"), [
    ([[1, 0], [0, 1]], "must be 3x3"),
    ([[1, 0, 0], [0, 1, 0]], "must be 3x3"),
    ([[0.5, 0.6, 0], [0.5, 0.4, 0], [0, 0, 1]], "row 0 sums to 1.1"),
    ([[0.5, 0.5, 0], [0.5, 0.5, 0], [0, 0, 0.9]], "row 2 sums to 0.9"),
    ([[1.5, -0.5, 0], [-0.5, 1.5, 0], [0, 0, 1]], "mixing[0][1] = -0.5 is negative"),
    ([[1, 0, 0], [0, 1, 0], [0, 0, "x"]], "mixing[2][2] must be a number"),
    ([[1, 0, 0], [0, 1, 0], [0, 0, True]], "mixing[2][2] must be a number"),
    ("ring", "must be \"uniform\""),
    ([[0.5, 0.5, 0], [0.5, 0, 0.5], [0.5, 0, 0.5]], "column 0 sums to 1.5"),
])
def test_bad_mixing_is_refused_by_name(matrix: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_job({"task": "digits", "mode": "ring", "min_nodes": 3, "mixing": matrix})
    assert message in str(err.value)


def test_ring_job_keys() -> None:
    job = parse_job({"task": "digits", "mode": "ring", "min_nodes": 2, "rounds": 3,
                     "iterations": 30, "local_steps": 2,
                     "mixing": [[0.25, 0.75], [0.75, 0.25]]})
    assert (job.mode, job.iterations, job.local_steps) == ("ring", 30, 2)
    assert job.mixing == [[0.25, 0.75], [0.75, 0.25]]
    assert parse_job({"task": "digits"}).mode == "star"
    for bad, key in (({"iterations": 2}, "'iterations'"), ({"local_steps": 0}, "'local_steps'"),
                     ({"fraction": 0.5}, "'fraction'"), ({"ring_timeout_s": 0}, "ring_timeout_s")):
        with pytest.raises(ConfigError, match=key):
            parse_job({"task": "digits", "mode": "ring", "rounds": 3, **bad})


def test_blocks_cover_every_iteration_once() -> None:
    for blocks, iterations in ((3, 36), (4, 10), (7, 7)):
        spans = [block_range(b, blocks, iterations) for b in range(1, blocks + 1)]
        covered = [k for first, count in spans for k in range(first, first + count)]
        assert covered == list(range(iterations))


def test_streamed_average_and_consensus_distance() -> None:
    rng = np.random.default_rng(1)
    copies = [{"w": rng.standard_normal((3, 4)).astype(np.float32),
               "step": np.array([5], dtype=np.int64)} for _ in range(4)]
    avg = RingAverage()
    avg.begin_round(copies[0])
    for c in copies:
        avg.add(UpdateIn(c, num_examples=1000))  # uniform, whatever the data size
    out = avg.finish()
    stacked = np.stack([c["w"] for c in copies]).astype(np.float64)
    np.testing.assert_allclose(out["w"], stacked.mean(0), rtol=1e-6)
    assert out["w"].dtype == np.float32 and out["step"].dtype == np.int64
    direct = np.mean([np.sum((x - stacked.mean(0)) ** 2) for x in stacked])
    assert avg.consensus_distance == pytest.approx(direct, rel=1e-9)


def test_peer_host() -> None:
    assert peer_host("ipv4:10.0.0.5:41000") == "10.0.0.5"
    assert peer_host("ipv6:[::1]:41000") == "::1"
