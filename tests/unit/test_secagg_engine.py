"""The aggregator's side of secure rounds inside the real round engine, in-process: nodes are
played by coroutines that answer their tasks through the same intake the gRPC and bulk paths
use. A site silent through training is dropped at advertise-keys by the round's deadline, a
late or repeated message is refused, and the new global model is the global plus plain
weighted FedAvg of the counted sites' changes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

from fedgpu.core.constants import Transport
from fedgpu.core.job import parse_job
from fedgpu.core.secagg import layout
from fedgpu.core.secagg.errors import Stage
from fedgpu.core.secagg.messages import KeyRelay, Setup, ShareRelay, UnmaskRequest
from fedgpu.core.secagg.params import Settings
from fedgpu.core.secagg.quantize import error_bound
from fedgpu.core.secagg.site import SiteSession
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rejections import UpdateRejected
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.receive import ingest
from fedgpu.server.transfer.uploads import Received

KIND = {Stage.ADVERTISE_KEYS: pb.TASK_KIND_SECAGG_ADVERTISE_KEYS,
        Stage.SHARE_KEYS: pb.TASK_KIND_SECAGG_SHARE_KEYS,
        Stage.MASKED_INPUT: pb.TASK_KIND_SECAGG_MASKED_INPUT,
        Stage.UNMASK: pb.TASK_KIND_SECAGG_UNMASK}
GLOBAL = {"a.weight": np.linspace(-1, 1, 600, dtype=np.float32).reshape(20, 30),
          "b.bias": np.zeros(7, dtype=np.float32), "steps": np.array([3], dtype=np.int64)}


def _orchestrator(deadline_s: float, timeout_s: float) -> tuple[Orchestrator, list[Node]]:
    job = parse_job({"task": "digits", "rounds": 1, "min_nodes": 3, "fraction": 1.0,
                     "min_available_nodes": 4, "evaluate": False,
                     "round_deadline_s": deadline_s, "round_retries": 0,
                     "secure_aggregation": {"stage_timeout_s": timeout_s}})
    registry = Registry()
    nodes = [registry.register(name=f"site-{i}", peer="test", version="0", devices={},
                               decision={}, labels={}, tasks=["digits"]) for i in range(4)]
    from fedgpu.server.secagg.plan import SecAggPlan

    return Orchestrator(job, registry, initial_weights=GLOBAL, plan=SecAggPlan(job)), nodes


def _receiver(data: bytes | bytearray):  # noqa: ANN202
    @contextlib.asynccontextmanager
    async def receive(rnd: object) -> AsyncIterator[Received]:
        yield Received(memoryview(bytes(data)), 0.0)
    return receive


async def _task(orch: Orchestrator, node: Node, kind: int) -> pb.TaskHeader | None:
    """The node's pending task of `kind`, as PullTask would serve it (None if the round ends)."""
    while not orch.finished.is_set():
        task = orch.task_for(node)
        if task is not None and task.kind == kind:
            return task.header
        await asyncio.sleep(0.01)
    return None


async def _payload(orch: Orchestrator, node: Node) -> bytes:
    task = orch.task_for(node)
    assert task is not None and task.payload is not None
    return b"".join(task.payload.chunks(1 << 20))


async def _send(orch: Orchestrator, node: Node, task: pb.TaskHeader, stage: Stage,
                data: bytes | bytearray, **fields: object) -> str:
    header = pb.UpdateHeader(node_id=node.node_id, task_id=task.task_id, round=task.round,
                             kind=KIND[stage], payload_size=len(data), **fields)
    return await ingest(orch, node, header, _receiver(data), Transport.GRPC)


async def _site(orch: Orchestrator, node: Node, change: np.ndarray, weight: int,
                silent: bool = False, metrics: dict[str, float] | None = None) -> None:
    task = await _task(orch, node, pb.TASK_KIND_TRAIN)
    assert task is not None and task.secagg_setup
    if silent:
        return  # "trains" past the round's deadline
    site = SiteSession(Setup.decode(task.secagg_setup))
    await _send(orch, node, task, Stage.ADVERTISE_KEYS, site.advertise().encode())
    relay = await _task(orch, node, pb.TASK_KIND_SECAGG_SHARE_KEYS)
    assert relay is not None
    keys = KeyRelay.decode(await _payload(orch, node))
    await _send(orch, node, task, Stage.SHARE_KEYS, site.share_keys(keys).encode())
    # Sent again (a retry whose first try got through): refused, and the site stays in.
    with pytest.raises(UpdateRejected, match="share-keys message arrived already"):
        await _send(orch, node, task, Stage.SHARE_KEYS, b"again")
    assert await _task(orch, node, pb.TASK_KIND_SECAGG_MASKED_INPUT) is not None
    shares = ShareRelay.decode(await _payload(orch, node))
    masked = site.masked_input(shares, change, weight, metrics=metrics).encode()
    await _send(orch, node, task, Stage.MASKED_INPUT, masked,
                train_metrics={"loss": 0.5})
    assert await _task(orch, node, pb.TASK_KIND_SECAGG_UNMASK) is not None
    request = UnmaskRequest.decode(await _payload(orch, node))
    await _send(orch, node, task, Stage.UNMASK, site.unmask(request).encode())


def test_a_silent_site_is_dropped_at_the_deadline_and_the_mean_is_fedavg() -> None:
    async def main() -> None:
        orch, nodes = _orchestrator(deadline_s=1.5, timeout_s=5)
        rng = np.random.default_rng(0)
        n = layout.length(GLOBAL)
        changes = [rng.uniform(-0.1, 0.1, n).astype(np.float32) for _ in nodes]
        weights = [10, 30, 60, 99]
        for node in nodes:
            # Stated at registration: they bound the weights, so the sum fits 32 bits.
            node.stated_examples = 100
        run = asyncio.create_task(orch.run())
        losses, steps = [0.9, 0.3, 0.1, 7.0], [2, 3, 6, 9]
        await asyncio.gather(*(_site(orch, node, changes[i], weights[i], silent=i == 3,
                                     metrics={"loss": losses[i], "examples": weights[i],
                                              "steps": steps[i], "examples_per_s": 100.5})
                               for i, node in enumerate(nodes)))
        await asyncio.wait_for(run, 30)
        assert orch.state == "finished", orch.error
        (record,) = orch.history.records
        sa = record.extra["secure_aggregation"]
        assert sa["dropped"] == {"advertise-keys": ["site-3"]}
        assert (sa["masked"], sa["total_weight"]) == (3, 100)
        # ring_bits = "auto": 4 sites x 128 (the power of two above 100) x 2^19 fits Z_2^32.
        assert (sa["ring_bits"], sa["max_weight"]) == (32, 128)
        # The training numbers came out of the masked vector as sums only: the
        # examples-weighted mean loss of the three that masked (not the 0.5 each header
        # still claims in the clear: the aggregator never averages what a header says).
        assert record.num_examples == 100
        assert record.train_loss == pytest.approx((10 * 0.9 + 30 * 0.3 + 60 * 0.1) / 100,
                                                  abs=1e-6)
        sums = record.extra["masked_metrics"]
        assert sums["examples"] == {"value": 100, "sites": 3}
        assert sums["steps"] == {"value": 11, "sites": 3}
        assert sums["examples_per_s"]["value"] == pytest.approx(301.5, abs=1e-3)
        mean = sum(w * c.astype(np.float64) for w, c in zip(weights[:3], changes[:3],
                                                             strict=True)) / 100
        want = layout.apply(GLOBAL, mean)
        got = orch.global_weights
        assert got is not None
        tol = error_bound(1.0, Settings().bits, True) + 1e-7
        for name in ("a.weight", "b.bias"):
            np.testing.assert_allclose(got[name], want[name], atol=tol)
        assert got["steps"].dtype == np.int64 and got["steps"][0] == 3
        # The repeated share-keys message of each site is listed with the round.
        assert [r.reason for r in record.rejected] == ["duplicate"] * 3

    asyncio.run(main())


def test_layout_round_trips_every_dtype() -> None:
    trained = {k: (v + 1).astype(v.dtype) for k, v in GLOBAL.items()}
    change = layout.delta(trained, GLOBAL)
    assert change.shape == (layout.length(GLOBAL),)
    np.testing.assert_allclose(change, 1, atol=1e-6)
    back = layout.apply(GLOBAL, change.astype(np.float64))
    for k, v in trained.items():
        np.testing.assert_allclose(back[k], v, atol=1e-6)
        assert back[k].dtype == v.dtype
    assert back["steps"][0] == 4  # integers come back rounded, exact


def test_the_secure_plan_owns_its_messages_and_refuses_them_between_rounds() -> None:
    # The round engine names no secure-aggregation kind: the job's plan says whose they are.
    from fedgpu.server.rounds.plans import StarPlan

    orch, nodes = _orchestrator(deadline_s=5.0, timeout_s=1.0)
    assert all(orch.plan.intake(kind) is not None for kind in KIND.values())
    assert orch.plan.intake(pb.TASK_KIND_TRAIN) is None  # plain updates: rounds/receive.py
    assert all(StarPlan(orch.job).intake(kind) is None for kind in KIND.values())
    # No attempt is open: its intake refuses the message, and the refusal is counted.
    header = pb.UpdateHeader(node_id=nodes[0].node_id, task_id="t", round=1,
                             kind=KIND[Stage.ADVERTISE_KEYS], payload_size=3)
    with pytest.raises(UpdateRejected) as refused:
        asyncio.run(ingest(orch, nodes[0], header, _receiver(b"abc"), Transport.GRPC))
    assert refused.value.reason == "stale_round"
    assert "not an open secure round" in refused.value.message
    assert orch.rejections["stale_round"] == 1
