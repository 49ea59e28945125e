"""Distributed DP inside the real round engine (in-process, as test_secagg_engine.py): a masked
input that carries no noise share is refused, and a sum of fewer inputs than the round needs is
never unmasked, so no noised sum leaves the protocol without being accounted."""

from __future__ import annotations

import asyncio

import numpy as np

from fedgpu.core.job import parse_job
from fedgpu.core.secagg import layout
from fedgpu.core.secagg.errors import Stage
from fedgpu.core.secagg.messages import KeyRelay, Setup, ShareRelay, UnmaskRequest
from fedgpu.core.secagg.site import SiteSession
from fedgpu.node.secagg import noise_share_of
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rejections import UpdateRejected
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.secagg.plan import SecAggPlan
from tests.unit.test_secagg_engine import GLOBAL, _payload, _send, _task


def _orchestrator() -> tuple[Orchestrator, list[Node]]:
    # Threshold 2 (a strict majority of the 3 shareholders with 2 neighbours each) of 4 sites,
    # but the round needs 3 updates: n_min = 2 < min_nodes.
    job = parse_job({"task": "digits", "rounds": 1, "min_nodes": 3, "fraction": 1.0,
                     "min_available_nodes": 4, "evaluate": False, "round_deadline_s": 5,
                     "round_retries": 0,
                     "secure_aggregation": {"stage_timeout_s": 3, "threshold": 2, "neighbours": 2,
                                            "clip": 6.0},
                     "privacy": {"mode": "distributed", "clip_norm": 1.0,
                                 "noise_multiplier": 1.0}})
    registry = Registry()
    nodes = [registry.register(name=f"site-{i}", peer="test", version="0", devices={},
                               decision={}, labels={}, tasks=["digits"]) for i in range(4)]
    return Orchestrator(job, registry, initial_weights=GLOBAL, plan=SecAggPlan(job)), nodes


async def _site(orch: Orchestrator, node: Node, change: np.ndarray, *, share: bool = True,
                mask: bool = True) -> str:
    """One site through the protocol; what became of its masked input."""
    task = await _task(orch, node, pb.TASK_KIND_TRAIN)
    assert task is not None and task.secagg_setup
    noise = noise_share_of(task)
    assert noise is not None and (noise.clip_norm, noise.noise_multiplier) == (1.0, 1.0)
    site = SiteSession(Setup.decode(task.secagg_setup))
    await _send(orch, node, task, Stage.ADVERTISE_KEYS, site.advertise().encode())
    assert await _task(orch, node, pb.TASK_KIND_SECAGG_SHARE_KEYS) is not None
    keys = KeyRelay.decode(await _payload(orch, node))
    await _send(orch, node, task, Stage.SHARE_KEYS, site.share_keys(keys).encode())
    assert await _task(orch, node, pb.TASK_KIND_SECAGG_MASKED_INPUT) is not None
    shares = ShareRelay.decode(await _payload(orch, node))
    if not mask:
        return "dropped"
    masked = site.masked_input(shares, change, 50.0, noise if share else None).encode()
    metrics = {"ddp_noise_std": noise.std(site.params.threshold)} if share else {}
    try:
        await _send(orch, node, task, Stage.MASKED_INPUT, masked, train_metrics=metrics)
    except UpdateRejected as exc:
        return f"refused: {exc.message}"
    if await _task(orch, node, pb.TASK_KIND_SECAGG_UNMASK) is None:
        return "no unmask request"
    request = UnmaskRequest.decode(await _payload(orch, node))
    await _send(orch, node, task, Stage.UNMASK, site.unmask(request).encode())
    return "counted"


def _changes(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.uniform(-3, 3, layout.length(GLOBAL)).astype(np.float32) for _ in range(count)]


def test_a_masked_input_without_a_noise_share_is_refused() -> None:
    async def main() -> None:
        orch, nodes = _orchestrator()
        changes = _changes(4)
        run = asyncio.create_task(orch.run())
        got = await asyncio.gather(*(_site(orch, n, changes[i], share=i != 3)
                                     for i, n in enumerate(nodes)))
        await asyncio.wait_for(run, 30)
        assert got[:3] == ["counted"] * 3
        assert got[3].startswith("refused: site-3 sent its masked input without a "
                                 "distributed-DP noise share"), got[3]
        assert orch.state == "finished", orch.error
        (record,) = orch.history.records
        assert record.extra["secure_aggregation"]["masked"] == 3
        priv = record.extra["privacy"]
        assert (priv["mode"], priv["updates"], priv["min_sites"]) == ("distributed", 3, 2)
        # Weight 1 each: the total weight counts sites, not the 50 examples each claimed.
        assert record.extra["secure_aggregation"]["total_weight"] == 3

    asyncio.run(main())


def test_a_sum_of_fewer_inputs_than_the_round_needs_is_never_unmasked() -> None:
    async def main() -> None:
        orch, nodes = _orchestrator()
        changes = _changes(4)
        run = asyncio.create_task(orch.run())
        got = await asyncio.gather(*(_site(orch, n, changes[i], mask=i < 2)
                                     for i, n in enumerate(nodes)))
        await asyncio.wait_for(run, 30)
        # Two inputs reach the threshold (2) but not min_nodes (3): no site is asked to unmask.
        assert got == ["no unmask request"] * 2 + ["dropped"] * 2
        assert orch.state == "failed"
        assert ("secure aggregation failed at masked-input: 2 sites left, the round needs 3; "
                "nothing was unmasked") in (orch.error or ""), orch.error

    asyncio.run(main())


def test_a_round_whose_range_would_cut_the_noise_does_not_start() -> None:
    # The noise is derived from the budget, so it is only known at the job's start and the
    # range is checked per round (with a given multiplier, submit refuses it already).
    job = parse_job({"task": "digits", "rounds": 3, "min_nodes": 3, "evaluate": False,
                     "round_retries": 0, "secure_aggregation": {"clip": 2.0},
                     "privacy": {"mode": "distributed", "clip_norm": 1.0,
                                 "target_epsilon": 2.0}})
    registry = Registry()
    for i in range(3):
        registry.register(name=f"site-{i}", peer="test", version="0", devices={}, decision={},
                          labels={}, tasks=["digits"])
    orch = Orchestrator(job, registry, initial_weights=GLOBAL, plan=SecAggPlan(job))

    async def main() -> None:
        await asyncio.wait_for(orch.run(), 30)

    asyncio.run(main())
    assert orch.state == "failed"
    assert "round 1: distributed DP cannot start: [secure_aggregation] clip = 2 cuts the " \
        "noise shares" in (orch.error or ""), orch.error
