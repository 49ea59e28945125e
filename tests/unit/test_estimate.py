"""The training-time estimate at submit (server/jobs/estimate.py): costed at the slowest
measured site that offers the task, None with nothing measured."""

from __future__ import annotations

import tomllib

from fedgpu.core.job import parse_job
from fedgpu.server.jobs.estimate import LONG_S, estimate
from fedgpu.server.registry import Node


def _node(name: str, tasks: list[str], examples: int = 0, **speed: float) -> Node:
    node = Node(node_id=name, name=name, peer="ipv4:127.0.0.1:1", version="t",
                registered_at=0.0, last_seen=0.0, devices={}, decision={}, labels={},
                tasks=tasks, stated_examples=examples)
    for task, eps in speed.items():
        node.measured(task, eps)
    return node


def _job(text: str):  # type: ignore[no-untyped-def]
    return parse_job(tomllib.loads(text), "job.toml")


def test_nothing_measured_means_no_estimate() -> None:
    job = _job('task = "digits"\nrounds = 10\n')
    assert estimate(job, [_node("a", ["digits"], 1000)]) is None
    # A node measured on another task says nothing about this one.
    assert estimate(job, [_node("a", ["digits", "images"], 1000, images=50.0)]) is None


def test_the_slowest_measured_site_sets_the_pace() -> None:
    job = _job('task = "digits"\nrounds = 10\n[hyperparameters]\nlocal_epochs = 3\n')
    fast = _node("gpu-1", ["digits"], 6000, digits=6000.0)
    slow = _node("cpu-1", ["digits"], 600, digits=6.0)
    other = _node("lm-1", ["causal-lm"], 10, **{"causal-lm": 1.0})
    unmeasured = _node("new-1", ["digits"], 600)
    est = estimate(job, [fast, slow, other, unmeasured])
    assert est is not None
    # cpu-1: 3 epochs x 600 examples at 6/s = 300 s a round, x 10 rounds.
    assert est["per_round_s"] == 300.0 and est["seconds"] == 3000.0
    assert est["slowest"] == "cpu-1" and est["examples_per_s"] == 6.0
    assert est["sites_measured"] == 2 and est["sites_unmeasured"] == 1
    assert not est["long"] and "50 min" in est["text"] and "cpu-1 at 6 examples/s" in est["text"]
    long_job = _job('task = "digits"\nrounds = 100\n[hyperparameters]\nlocal_epochs = 3\n')
    est = estimate(long_job, [fast, slow])
    assert est is not None and est["long"] and est["seconds"] > LONG_S
    assert "8 h 20 min" in est["text"] and "round_train_s" in est["text"]


def test_step_caps_and_time_budgets_bound_a_round() -> None:
    slow = _node("cpu-1", ["digits"], 600, digits=6.0)
    capped = _job('task = "digits"\nrounds = 2\n[hyperparameters]\nmax_train_seconds = 30\n')
    est = estimate(capped, [slow])
    assert est is not None and est["per_round_s"] == 30.0
    timed = _job('task = "digits"\nrounds = 4\nlocal_work = "time"\nround_train_s = 20\n'
                 'round_deadline_s = 120\nstrategy = "fednova"\n')
    est = estimate(timed, [slow])
    assert est is not None and est["seconds"] == 80.0


def test_a_node_keeps_a_bounded_list_of_speeds() -> None:
    node = _node("a", [])
    for i in range(40):
        node.measured(f"task-{i}", 1.0 + i)
    node.measured("bad", float("nan"))
    node.measured("neg", -1.0)
    assert len(node.throughput) == 16 and "task-39" in node.throughput
    assert "bad" not in node.throughput and "neg" not in node.throughput


def test_short_durations_say_how_short_not_zero() -> None:
    from fedgpu.server.jobs.estimate import duration

    assert duration(0.2) == "under 1 s"
    assert duration(2.46) == "2.5 s"
    assert duration(42) == "42 s"
    assert duration(600) == "10 min"
