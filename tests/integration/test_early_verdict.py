"""A training update's verdict goes out once nothing can refuse it, before its fold ends
(server/rounds/folding.py), and its node is never handed the same task again meanwhile.

In-process: the real round engine, a node played by a coroutine sending through the same
`ingest` the bulk port uses, and a FedAvg whose sum waits on a gate (the collaborator held
still, so the window between verdict and sum is long enough to look into). Over the wire: a
real aggregator with a bulk port and a real `fedgpu sim` node, whose pushes and trainings are
counted: one each per round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from fedgpu.cli.report.plots import load_state_dir
from fedgpu.core import codec
from fedgpu.core.constants import Transport
from fedgpu.core.job import parse_job
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.attempt import Task
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.receive import ingest
from fedgpu.server.strategies.fedavg import FedAvg
from fedgpu.server.strategies.update import UpdateIn
from fedgpu.server.transfer.uploads import Received
from tests.fixtures.federation import Federation, free_port, write_job

GLOBAL = {"w": np.zeros((64, 32), np.float32), "b": np.zeros(32, np.float32)}


class Gated(FedAvg):
    """FedAvg whose sum waits for `gate` once it has started (`folding`)."""

    def __init__(self) -> None:
        super().__init__()
        self.folding = threading.Event()
        self.gate = threading.Event()

    def add(self, update: UpdateIn) -> None:
        self.folding.set()
        assert self.gate.wait(20), "the test never opened the gate"
        super().add(update)


def _receiver(data: bytes):  # noqa: ANN202
    @contextlib.asynccontextmanager
    async def receive(rnd: object) -> AsyncIterator[Received]:
        yield Received(memoryview(data), 0.0)
    return receive


async def _until(check, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    end = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def _one_site_round() -> tuple[Orchestrator, Node, Gated, asyncio.Task[None]]:
    """A one-round FedAvg job on one site, running, its round open."""
    job = parse_job({"task": "digits", "rounds": 1, "min_nodes": 1, "evaluate": False,
                     "round_deadline_s": 30, "round_retries": 0})
    registry = Registry()
    node = registry.register(name="site-0", peer="test", version="0", devices={},
                             decision={}, labels={}, tasks=["digits"])
    orch = Orchestrator(job, registry, initial_weights=GLOBAL)
    gated = orch.strategy = Gated()
    run = asyncio.create_task(orch.run())
    await _until(lambda: orch.task_for(node) is not None, "the round's task")
    return orch, node, gated, run


def _answer(node: Node, task: Task, update: dict[str, np.ndarray]
            ) -> tuple[bytes, pb.UpdateHeader]:
    data = codec.encode(update).to_bytes()
    return data, pb.UpdateHeader(node_id=node.node_id, task_id=task.task_id,
                                 round=task.header.round, kind=pb.TASK_KIND_TRAIN,
                                 num_examples=10, payload_size=len(data))


def test_the_node_is_told_while_its_update_folds_and_not_handed_the_task_again() -> None:
    async def main() -> None:
        orch, node, gated, run = await _one_site_round()
        task = orch.task_for(node)
        assert task is not None and task.kind == pb.TASK_KIND_TRAIN
        update = {"w": np.full((64, 32), 0.5, np.float32), "b": np.ones(32, np.float32)}
        data, header = _answer(node, task, update)
        told: list[str] = []
        taking = asyncio.create_task(ingest(orch, node, header, _receiver(data),
                                            Transport.BULK, told=told.append))
        await _until(lambda: bool(told), "the verdict")
        # Told while the sum is still held at its gate: the upload is not over, the update not
        # yet recorded, and a poll now gets no task (the same one again would train twice).
        assert told == [f"update for round {task.header.round} accepted"]
        assert gated.folding.is_set() and not taking.done()
        assert orch.current is not None and orch.current.updates == []
        assert orch.task_for(node) is None
        gated.gate.set()
        assert await asyncio.wait_for(taking, 10) == told[0]
        await asyncio.wait_for(run, 30)
        assert orch.state == "finished", orch.error
        (record,) = orch.history.records
        assert [u.node for u in record.updates] == ["site-0"]
        assert orch.global_weights is not None
        np.testing.assert_array_equal(orch.global_weights["w"], update["w"])
        np.testing.assert_array_equal(orch.global_weights["b"], update["b"])

    asyncio.run(main())


def test_without_a_way_to_tell_early_the_verdict_is_the_return_after_the_fold() -> None:
    # The gRPC path passes no `told`: its reply is PushUpdate's return, after the sum.
    async def main() -> None:
        orch, node, gated, run = await _one_site_round()
        task = orch.task_for(node)
        assert task is not None
        data, header = _answer(node, task, {k: np.ones_like(v) for k, v in GLOBAL.items()})
        taking = asyncio.create_task(ingest(orch, node, header, _receiver(data),
                                            Transport.GRPC))
        await _until(gated.folding.is_set, "the fold")
        await asyncio.sleep(0.1)
        assert not taking.done()
        # Until the sum is written the task stays the node's (as before: a retry resumes it).
        assert orch.task_for(node) is not None
        gated.gate.set()
        assert await asyncio.wait_for(taking, 10) == "update for round 1 accepted"
        await asyncio.wait_for(run, 30)
        assert orch.state == "finished", orch.error

    asyncio.run(main())


@pytest.mark.timeout(180)
def test_a_sim_node_over_the_bulk_port_pushes_and_trains_once_a_round(tmp_path: Path) -> None:
    # 16 MiB updates: the aggregator's fold of each (a fresh sum's pages faulted in) outlasts
    # the node's next poll, which the verdict now precedes.
    rounds = 3
    job = write_job(tmp_path / "job.toml", task="synthetic", rounds=rounds, min_nodes=1,
                    evaluate=False, use_gpu=False, round_deadline_s=120, hyperparameters={})
    fed = Federation(tmp_path)
    try:
        fed.start_server(job, "--state-dir", str(tmp_path / "state"), "--bulk-port",
                         str(free_port()), "--exit-when-done")
        stats = tmp_path / "sim.json"
        sim = fed.spawn("sim", ["sim", "--aggregator", fed.address, "--nodes", "1",
                                "--params", str(4 << 20), "--tensors", "4", "--poll-s", "1",
                                "--stats", str(stats)])
        assert sim.popen.wait(timeout=150) == 0, sim.text()[-3000:]
        sent = json.loads(stats.read_text())
        assert sent["errors"] == [], sent["errors"]
        assert sent["tasks"] == {"init": 1, "train": rounds}, sent["tasks"]
        # The initial model, then one update a round: nothing sent twice, all over bulk.
        assert [p["transport"] for p in sent["pushes"]] == ["bulk"] * (rounds + 1), sent
        history = [r for r in load_state_dir(tmp_path / "state").rounds if r["round"] >= 1]
        assert [r["status"] for r in history] == ["finished"] * rounds, history
        assert all([u["node"] for u in r["updates"]] == ["sim-00000"] for r in history)
    finally:
        fed.stop()
