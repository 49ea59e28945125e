"""One unmasking per round, on the aggregator's side, in the real round engine.

Threat model: an aggregator that follows the code but keeps what it sees. Were an attempt
unmasked below min_nodes and then retried, it would hold sum(A, B) and sum(A, B, C) of one
round: their difference is C's update, and the two published total weights give C's example
count. So an attempt that cannot reach min_nodes inputs fails before any unmask request goes
out (in every mode, not only under distributed DP), publishes no sum, weight or count, and its
retry (nothing was revealed) completes.
"""

from __future__ import annotations

import asyncio

import numpy as np

from fedgpu.core.job import parse_job
from fedgpu.core.secagg import layout
from fedgpu.core.secagg.errors import Stage
from fedgpu.core.secagg.messages import KeyRelay, Setup, ShareRelay, UnmaskRequest
from fedgpu.core.secagg.site import SiteSession
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.secagg.plan import SecAggPlan
from tests.unit.test_secagg_engine import GLOBAL, _payload, _send, _task


async def _next(orch: Orchestrator, node: Node, kinds: set[int]) -> pb.TaskHeader | None:
    while not orch.finished.is_set():
        task = orch.task_for(node)
        if task is not None and task.kind in kinds:
            return task.header
        await asyncio.sleep(0.01)
    return None


async def _site(orch: Orchestrator, node: Node, change: np.ndarray, masks: tuple[bool, ...]
                ) -> list[str]:
    """The site through one attempt per entry of `masks` (False: it leaves before masking);
    what became of each attempt for it."""
    seen = []
    task = await _task(orch, node, pb.TASK_KIND_TRAIN)
    for mask in masks:
        assert task is not None
        site = SiteSession(Setup.decode(task.secagg_setup))
        await _send(orch, node, task, Stage.ADVERTISE_KEYS, site.advertise().encode())
        assert await _task(orch, node, pb.TASK_KIND_SECAGG_SHARE_KEYS) is not None
        keys = KeyRelay.decode(await _payload(orch, node))
        await _send(orch, node, task, Stage.SHARE_KEYS, site.share_keys(keys).encode())
        assert await _task(orch, node, pb.TASK_KIND_SECAGG_MASKED_INPUT) is not None
        shares = ShareRelay.decode(await _payload(orch, node))
        if mask:
            masked = site.masked_input(shares, change, 50.0).encode()
            await _send(orch, node, task, Stage.MASKED_INPUT, masked)
        got = await _next(orch, node, {pb.TASK_KIND_SECAGG_UNMASK, pb.TASK_KIND_TRAIN})
        if got is not None and got.kind == pb.TASK_KIND_SECAGG_UNMASK:
            request = UnmaskRequest.decode(await _payload(orch, node))
            await _send(orch, node, task, Stage.UNMASK, site.unmask(request).encode())
            seen.append("unmasked")
            task = await _task(orch, node, pb.TASK_KIND_TRAIN)
        else:
            seen.append("no unmask request" if mask else "left")
            task = got
    return seen


def _orchestrator(sites: int, retries: int, **secagg: object
                  ) -> tuple[Orchestrator, list[Node]]:
    # No privacy: plain secure aggregation, min_nodes 3.
    job = parse_job({"task": "digits", "rounds": 1, "min_nodes": 3, "fraction": 1.0,
                     "min_available_nodes": sites, "evaluate": False, "round_deadline_s": 5,
                     "round_retries": retries,
                     "secure_aggregation": {"stage_timeout_s": 2, **secagg}})
    registry = Registry()
    nodes = [registry.register(name=f"site-{i}", peer="test", version="0", devices={},
                               decision={}, labels={}, tasks=["digits"])
             for i in range(sites)]
    return Orchestrator(job, registry, initial_weights=GLOBAL, plan=SecAggPlan(job)), nodes


def _changes() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.uniform(-0.5, 0.5, layout.length(GLOBAL)).astype(np.float32)
            for _ in range(4)]


def test_dropouts_before_masking_then_a_retry_unmask_one_sum() -> None:
    async def main() -> None:
        # The case: three sites, min_nodes 3, threshold 2 (a majority of 3).
        orch, nodes = _orchestrator(3, retries=1)
        changes = _changes()
        run = asyncio.create_task(orch.run())
        # Attempt 1: the third site leaves before masking. Two inputs reach the threshold but
        # not min_nodes: nothing is unmasked.
        got = await asyncio.wait_for(asyncio.gather(
            *(_site(orch, n, changes[i], (i < 2, True)) for i, n in enumerate(nodes))), 60)
        await asyncio.wait_for(run, 30)
        assert got == [["no unmask request", "unmasked"]] * 2 + [["left", "unmasked"]]
        assert orch.state == "finished", orch.error
        first, second = orch.history.records
        assert (first.status, second.status) == ("retried", "finished")
        # The failed attempt publishes no sum, no weight, no count of inputs.
        sa = first.extra["secure_aggregation"]
        assert "failed" in sa and not {"masked", "total_weight", "recovered"} & set(sa)
        assert "nothing was unmasked" in sa["failed"]["reason"]
        assert first.num_examples == 0 and first.updates == [] and first.train_loss is None
        assert first.extra["secure_aggregation"]["threshold"] == 2
        # The retry unmasked the one sum of this round, of all three sites.
        assert second.extra["secure_aggregation"]["masked"] == 3
        assert second.num_examples == 3 * 50

    asyncio.run(main())


def test_two_inputs_above_the_threshold_but_below_min_nodes_are_never_unmasked() -> None:
    async def main() -> None:
        # Threshold 2 (2 neighbours each, 3 shareholders), min_nodes 3: without distributed
        # DP too, two masked inputs end the attempt before any unmask request.
        orch, nodes = _orchestrator(4, retries=0, neighbours=2, threshold=2)
        changes = _changes()
        run = asyncio.create_task(orch.run())
        got = await asyncio.wait_for(asyncio.gather(
            *(_site(orch, n, changes[i], (i < 2,)) for i, n in enumerate(nodes))), 60)
        await asyncio.wait_for(run, 30)
        assert got == [["no unmask request"]] * 2 + [["left"]] * 2
        assert orch.state == "failed"
        assert ("secure aggregation failed at masked-input: 2 sites left, the round needs 3"
                in (orch.error or "")), orch.error
        (record,) = orch.history.records
        assert "total_weight" not in record.extra["secure_aggregation"]

    asyncio.run(main())
