"""The per-mode plans the round loop drives: which nodes, which headers, who to blame.

Plain data in, answers out: the plans are tested without a server; the loop itself runs in
the integration tests (test_federation, test_ring, test_faults)."""

from __future__ import annotations

import time

import pytest

from fedgpu.core.job import parse_job
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.attempt import RoundState, RunFailed
from fedgpu.server.rounds.plans import InitPlan, StarPlan
from fedgpu.server.rounds.records import Failure
from fedgpu.server.rounds.ring import RingPlan, block_error
from fedgpu.server.rounds.states import SlotState


class Run:
    run_id = "run-1"
    global_round = 4


def nodes(n: int, ring_port: int = 29500) -> list[Node]:
    reg = Registry()
    out = [reg.register(f"node-{i}", f"ipv4:10.0.0.{i}:4000", "0", {}, {}, {}, [])
           for i in range(n)]
    for node in out:
        node.ring_port = ring_port
    return out


def attempt(chosen: list[Node], number: int = 5) -> RoundState:
    rnd = RoundState(number=number, kind=pb.TASK_KIND_TRAIN, attempt=1, required=len(chosen),
                     deadline=time.time() + 60, started=time.time())
    for n in chosen:
        rnd.slots[n.node_id] = SlotState.ASSIGNED
    return rnd


def test_ring_plan_ranks_by_name_and_sends_the_assignment() -> None:
    job = parse_job({"task": "t", "mode": "ring", "min_nodes": 3, "rounds": 4,
                     "iterations": 40, "seed": 7})
    plan = RingPlan(job)
    plan.bind(Run())
    pool = list(reversed(nodes(4)))
    chosen = plan.choose(pool, 1, 1)
    assert [n.name for n in chosen] == ["node-0", "node-1", "node-2"]
    fields = plan.task_fields(2, 1, chosen)
    rings = [f["ring"] for f in fields]
    assert [r.rank for r in rings] == [0, 1, 2]
    assert {f["seed"] for f in fields} == {7}
    assert rings[0].master_addr == "10.0.0.0" and rings[0].run_id == "run-1"
    assert (rings[0].first_iteration, rings[0].iterations) == (10, 10)
    assert rings[0].restart and list(rings[0].peers) == ["node-0", "node-1", "node-2"]
    with pytest.raises(RunFailed, match="node-0 \\(rank 0\\) announced no ring port"):
        plan.task_fields(2, 1, nodes(3, ring_port=0))


def test_star_plan_samples_and_seeds_per_attempt() -> None:
    job = parse_job({"task": "t", "min_nodes": 2, "fraction": 0.5, "seed": 3})
    plan = StarPlan(job)
    pool = nodes(6)
    first = plan.choose(pool, 1, 1)
    assert len(first) == 3 and plan.required(first) == 2
    assert plan.choose(list(reversed(pool)), 1, 1) == first
    assert plan.task_fields(1, 2, first)[0] == {"seed": 3 * 1_000_003 + 1009 + 2}
    init = InitPlan(job)
    assert [init.choose(pool, 0, a)[0].name for a in (1, 2, 7)] == ["node-0", "node-1", "node-0"]


def test_block_error_blames_the_rank_the_others_lost() -> None:
    chosen = nodes(3)
    rnd = attempt(chosen)
    # Ranks 0 and 1 stopped because rank 2 went away; rank 2 never answered.
    for n in chosen[:2]:
        rnd.failures.append(Failure(n.node_id, n.name, "ring lost node-2: rank stopped"))
        rnd.lost_ranks[n.node_id] = [2]
        rnd.settle(n.node_id, SlotState.FAILED, time.time())
    rnd.slots[chosen[2].node_id] = SlotState.DROPPED
    msg = block_error(rnd, chosen)
    assert msg.startswith("ring block 5 lost rank 2 (node-2) (node-2: no answer (node lost))")
    assert msg.endswith("the other ranks stopped: node-0, node-1")


def test_block_error_uses_lost_ranks_when_nobody_else_is_to_blame() -> None:
    chosen = nodes(3)
    rnd = attempt(chosen)
    # The prose does not matter any more: only the structured field names the rank.
    rnd.failures.append(Failure(chosen[0].node_id, "node-0", "gave up (rank 9 (x) in text)"))
    rnd.lost_ranks[chosen[0].node_id] = [1]
    assert block_error(rnd, chosen).startswith("ring block 5 lost rank 1 (node-1)")
    # A failure that names no lost rank is the cause itself.
    own = attempt(chosen)
    own.failures.append(Failure(chosen[2].node_id, "node-2", "CUDA out of memory"))
    assert block_error(own, chosen).startswith(
        "ring block 5 lost rank 2 (node-2) (node-2: CUDA out of memory)")


def test_ring_stops_waiting_after_the_failure_grace() -> None:
    job = parse_job({"task": "t", "mode": "ring", "min_nodes": 2, "ring_timeout_s": 5})
    plan = RingPlan(job)
    reg = Registry()
    chosen = [reg.register(f"n{i}", "p", "0", {}, {}, {}, []) for i in range(2)]
    rnd = attempt(chosen)
    now = time.time()
    assert not plan.stop_waiting(rnd, reg, now)
    rnd.settle(chosen[0].node_id, SlotState.FAILED, now)
    assert not plan.stop_waiting(rnd, reg, now + 10)
    assert plan.stop_waiting(rnd, reg, now + 21)


def test_a_closed_rounds_line_has_its_loss_time_and_the_previous_models_evaluation() -> None:
    from fedgpu.server.rounds.plans import round_line
    from fedgpu.server.rounds.records import Resources, RoundRecord, UpdateRecord

    def update(n_eval: int, loss: float, acc: float) -> UpdateRecord:
        return UpdateRecord(node_id="a", node="a", num_examples=10, train_metrics={},
                            eval_metrics={"loss": loss, "accuracy": acc},
                            num_eval_examples=n_eval, resources=Resources(), upload_s=None,
                            gpu_decision={})

    rec = RoundRecord(round=3, attempt=1, status="ok", started_at=0.0, duration_s=1.25,
                      participants=["a", "b"], nodes_reporting=2, dropped=[], train_loss=0.5,
                      num_examples=20, bytes_received=0, aggregation_s=0.0,
                      updates=[update(10, 1.0, 0.5), update(30, 2.0, 0.9)])
    assert round_line(rec) == ("round 3 closed: 2 updates, train loss 0.5000, 1.2 s; "
                               "model of round 2: loss 1.7500, accuracy 0.8000")
