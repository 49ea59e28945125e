"""The round engine in-process (server/rounds/engine.py): accept, refuse, retry, close at the
deadline, give up. No processes and no gRPC: fake nodes are coroutines on the test's event loop
that take their tasks from the engine (`task_for`) and answer through the same call the
Federation service makes (`receive.ingest`), with payloads in wire format. The engine keeps its
state in a MemoryStore and a checkpoint directory, as a job does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.core.constants import RoundStatus, RunState, Transport
from fedgpu.core.finite_scan import FiniteResult
from fedgpu.core.job import parse_job
from fedgpu.proto import pb
from fedgpu.server.jobs.job_checkpoint import JobCheckpoint
from fedgpu.server.jobs.memory_store import MemoryStore
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.receive import ingest
from fedgpu.server.transfer.uploads import Received

W0 = {"w": np.zeros(4, np.float32)}


@dataclass
class Answer:
    """What a fake node sends for one task: weights (all equal to `value`), a failure, or
    nothing at all (`silent`)."""

    value: float = 1.0
    examples: int = 10
    failed: str = ""
    silent: bool = False
    tensors: dict[str, np.ndarray] | None = None
    # The finite check its receiver took as the bytes landed (the bulk path's large uploads).
    finite: FiniteResult | None = None


# (node name, round, attempt) -> the node's answer.
Behaviour = Callable[[str, int, int], Answer]


@dataclass
class Harness:
    orch: Orchestrator
    store: MemoryStore
    nodes: dict[str, Node]
    refused: list[tuple[str, UpdateRejected]] = field(default_factory=list)
    headers: dict[str, pb.UpdateHeader] = field(default_factory=dict)

    def records(self) -> list[dict[str, Any]]:
        return self.orch.history.dicts()


def _receive(blob: bytes | None, finite: FiniteResult | None = None
             ) -> Callable[[RoundState], Any]:
    @asynccontextmanager
    async def receive(rnd: RoundState) -> AsyncIterator[Received | None]:
        yield None if blob is None else Received(memoryview(blob), 0.01, finite=finite)

    return receive


async def _node(h: Harness, node: Node, behaviour: Behaviour) -> None:
    """One fake node: wait for a task, answer it once, until the run ends."""
    answered: set[str] = set()
    while not h.orch.finished.is_set():
        task = h.orch.task_for(node)
        if task is None or task.task_id in answered:
            node.wakeup.clear()
            try:
                await asyncio.wait_for(node.wakeup.wait(), timeout=0.05)
            except TimeoutError:
                pass
            continue
        answered.add(task.task_id)
        attempt = sum(1 for r in h.orch.history.records if r.round == task.round) + 1
        ans = behaviour(node.name, task.round, attempt)
        header = pb.UpdateHeader(node_id=node.node_id, task_id=task.task_id, round=task.round,
                                 kind=task.kind, num_examples=ans.examples,
                                 train_metrics={"loss": 1.0 / (1 + ans.value)})
        h.headers[node.name] = header
        if ans.silent:
            continue
        blob = None
        if ans.failed:
            header.failed, header.error = True, ans.failed
        else:
            tensors = ans.tensors or {"w": np.full(4, ans.value, np.float32)}
            blob = codec.encode(tensors).to_bytes()
            header.payload_size = len(blob)
        try:
            await ingest(h.orch, node, header, _receive(blob, ans.finite), Transport.GRPC)
        except UpdateRejected as exc:
            h.refused.append((node.name, exc))


def run(tmp_path: Path, behaviour: Behaviour, names: tuple[str, ...] = ("a", "b"),
        timeout: float = 20, **job: Any) -> Harness:
    spec = {"task": "t", "rounds": 1, "min_nodes": 2, "evaluate": False, "round_retries": 0,
            "round_deadline_s": 5, **job}

    async def go() -> Harness:
        registry = Registry(heartbeat_interval_s=3600)  # nobody times out during a test
        nodes = {n: registry.register(n, "test", "0", {}, {}, {}, ["t"]) for n in names}
        store = MemoryStore()
        store.add_job(job_id="j", name="j", task="t", job_toml="", job=spec, source="submit",
                      source_sha256="", submitted_by="test", rounds=spec["rounds"],
                      state_dir="jobs/j")
        orch = Orchestrator(parse_job(spec), registry, initial_weights=W0,
                            checkpointer=JobCheckpoint(tmp_path, store, "j"), job_id="j")
        h = Harness(orch, store, nodes)
        workers = [asyncio.create_task(_node(h, n, behaviour)) for n in nodes.values()]
        try:
            await asyncio.wait_for(orch.run(), timeout)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        return h

    return asyncio.run(go())


def everyone(value: float = 1.0) -> Behaviour:
    return lambda name, number, attempt: Answer(value=value)


def test_accepted_updates_are_averaged_into_the_next_model(tmp_path: Path) -> None:
    values = {"a": (1.0, 10), "b": (3.0, 30)}
    h = run(tmp_path, lambda name, number, attempt: Answer(*values[name]), rounds=2)
    assert h.orch.state == RunState.FINISHED and h.refused == []
    # FedAvg weighted by examples, twice (each round's nodes send the same weights).
    np.testing.assert_allclose(h.orch.global_weights["w"], 2.5)  # type: ignore[index]
    recs = h.records()
    assert [(r["round"], r["status"], r["nodes_reporting"]) for r in recs] == [
        (1, "finished", 2), (2, "finished", 2)]
    assert sorted(u["node"] for u in recs[0]["updates"]) == ["a", "b"]
    assert recs[0]["num_examples"] == 40
    # The history is in the store (once); the checkpoint holds the engine's state.
    saved = h.store.history("j")
    assert saved is not None and saved.records == recs and saved.global_round == 2
    on_disk = json.loads((tmp_path / "state.json").read_text())
    assert on_disk["global_round"] == 2 and "history" not in on_disk
    row = h.store.get("j")
    assert row is not None and row.rounds_done == 2


def test_a_refused_update_is_listed_and_leaves_the_model_alone(tmp_path: Path) -> None:
    def behaviour(name: str, number: int, attempt: int) -> Answer:
        if name == "c":  # the wrong shape: refused before it touches the aggregate
            return Answer(value=100.0, tensors={"w": np.full(5, 100.0, np.float32)})
        return Answer(value=2.0)

    h = run(tmp_path, behaviour, names=("a", "b", "c"))
    assert h.orch.state == RunState.FINISHED
    ((name, exc),) = h.refused
    assert name == "c" and exc.reason == Reject.SHAPE
    np.testing.assert_allclose(h.orch.global_weights["w"], 2.0)  # type: ignore[index]
    (rec,) = h.records()
    assert rec["status"] == "finished" and rec["nodes_reporting"] == 2
    assert [(r["node"], r["reason"]) for r in rec["rejected"]] == [("c", "shape")]
    assert h.orch.rejections == {"shape": 1}
    # Sent again once the round closed, the same answer is refused as late.
    with pytest.raises(UpdateRejected) as again:
        h.orch.answers.check_update(h.nodes["c"], h.headers["c"])
    assert again.value.reason == Reject.LATE


def test_the_finite_check_taken_as_the_bytes_landed_decides(tmp_path: Path) -> None:
    """A payload's scan (fedgpu/core/finite_scan.py) reaches validation through the round's
    receive: one that found a NaN refuses the update as non-finite (here the bytes are clean,
    so only the scan can have refused it), one of other tensors is ignored for the check
    after the last byte."""
    def behaviour(name: str, number: int, attempt: int) -> Answer:
        if name == "c":
            return Answer(value=2.0, finite=FiniteResult(("w",), {}, "w"))
        if name == "b":
            return Answer(value=2.0, finite=FiniteResult(("v",), {"v": 1.0}, None))
        return Answer(value=2.0, finite=FiniteResult(("w",), {"w": 4.0}, None))

    h = run(tmp_path, behaviour, names=("a", "b", "c"))
    assert h.orch.state == RunState.FINISHED
    ((name, exc),) = h.refused
    assert name == "c" and exc.reason == Reject.NON_FINITE
    np.testing.assert_allclose(h.orch.global_weights["w"], 2.0)  # type: ignore[index]


def test_a_failed_attempt_is_retried_and_recorded(tmp_path: Path) -> None:
    def behaviour(name: str, number: int, attempt: int) -> Answer:
        if attempt == 1:
            return Answer(failed="CUDA out of memory") if name == "b" else Answer(value=100.0)
        return Answer(value=4.0)

    h = run(tmp_path, behaviour, round_retries=1)
    assert h.orch.state == RunState.FINISHED
    first, second = h.records()
    assert (first["round"], first["attempt"], first["status"]) == (1, 1, RoundStatus.RETRIED)
    assert [f["error"] for f in first["failures"]] == ["CUDA out of memory"]
    assert (second["round"], second["attempt"], second["status"]) == (1, 2, "finished")
    np.testing.assert_allclose(h.orch.global_weights["w"], 4.0)  # type: ignore[index]
    # a's update of the retried attempt (100) did not leak into the committed model.
    assert first["nodes_reporting"] == 1 and second["nodes_reporting"] == 2


def test_the_deadline_drops_a_silent_node_and_closes_the_round(tmp_path: Path) -> None:
    def behaviour(name: str, number: int, attempt: int) -> Answer:
        return Answer(silent=name == "c", value=1.0)

    h = run(tmp_path, behaviour, names=("a", "b", "c"), round_deadline_s=0.5)
    assert h.orch.state == RunState.FINISHED
    (rec,) = h.records()
    assert rec["status"] == "finished" and rec["dropped"] == [h.nodes["c"].node_id]
    assert rec["nodes_reporting"] == 2 and not h.nodes["c"].assigned
    # Its answer after the close is refused as late, and filed under the closed round.
    with pytest.raises(UpdateRejected) as late:
        asyncio.run(ingest(h.orch, h.nodes["c"], h.headers["c"], _receive(None),
                           Transport.GRPC))
    assert late.value.reason == Reject.LATE
    assert h.orch.rejections == {"late": 1}
    assert [r["reason"] for r in h.records()[0]["rejected"]] == ["late"]


def test_a_round_that_never_gets_enough_updates_fails_the_run(tmp_path: Path) -> None:
    def behaviour(name: str, number: int, attempt: int) -> Answer:
        return Answer(failed="no data") if name == "b" else Answer()

    h = run(tmp_path, behaviour, round_retries=1)
    assert h.orch.state == RunState.FAILED
    assert h.orch.error is not None and "2 attempts" in h.orch.error
    assert [(r["attempt"], r["status"]) for r in h.records()] == [(1, "retried"),
                                                                 (2, "retried")]
    # The model stays the starting one.
    np.testing.assert_array_equal(h.orch.global_weights["w"], W0["w"])  # type: ignore[index]
    assert h.orch.global_round == 0


def test_a_job_that_never_gets_its_nodes_fails_after_queue_timeout_s(tmp_path: Path) -> None:
    # Two nodes are needed and one is there: the job waits, then gives up with the count.
    h = run(tmp_path, everyone(), names=("a",), min_nodes=2, queue_timeout_s=0.5)
    assert h.orch.state == RunState.FAILED and h.orch.global_round == 0
    assert h.orch.error is not None and "never started" in h.orch.error
    assert "2 nodes that can take it were needed and 1 could" in h.orch.error
    assert "queue_timeout_s = 0.5 s" in h.orch.error and h.records() == []
