"""The aggregator's side of `mode = "statistics"` in-process (server/rounds/statistics.py on the
real round engine, no gRPC): fake sites answer the STATISTICS task with their documents through
the same call the Federation service makes; the round's record holds the per-site and combined
figures; a site's bad document is refused (MALFORMED), counted, and no part of the combination;
the run ends after one round with nothing trained and its history stored.

Threat model: docs/explanation/federated-statistics.md."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core.constants import RunState, Transport
from fedgpu.core.fedstats import wire
from fedgpu.core.fedstats.columns import ColumnSpec, summarize
from fedgpu.core.fedstats.release import ReleaseSettings, release
from fedgpu.core.job import parse_job
from fedgpu.proto import pb
from fedgpu.server.jobs.job_checkpoint import JobCheckpoint
from fedgpu.server.jobs.memory_store import MemoryStore
from fedgpu.server.registry import Registry
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.receive import ingest
from fedgpu.server.rounds.statistics import StatsPlan
from tests.unit.test_engine import _receive

SPEC = ColumnSpec("x", 0.0, 10.0, 10)
DATA = {"a": np.arange(0, 10, 0.25), "b": np.arange(2, 8, 0.1)}


def _doc(name: str) -> str:
    if name == "evil":
        return json.dumps({"version": 1, "columns": [{"name": "x", "lo": 0, "hi": 10, "bins": 10,
                                                      "per_record": 1, "suppressed": False,
                                                      "count": -5, "sum": 0, "sum_sq": 0,
                                                      "histogram": [1] * 10}]})
    rel = release([summarize(SPEC, DATA[name])], ReleaseSettings(min_count=1),
                  np.random.default_rng(0))
    return wire.dumps(rel)


def test_one_round_of_statistics_combines_the_good_sites_and_refuses_the_bad(
        tmp_path: Path) -> None:
    spec = {"task": "t", "mode": "statistics", "min_nodes": 2, "round_deadline_s": 5,
            "statistics": {"min_count": 1}}
    refused: list[tuple[str, UpdateRejected]] = []

    async def go() -> tuple[Orchestrator, MemoryStore]:
        registry = Registry(heartbeat_interval_s=3600)
        nodes = {n: registry.register(n, "test", "0", {}, {}, {}, ["t"])
                 for n in ("a", "b", "evil")}
        store = MemoryStore()
        store.add_job(job_id="j", name="j", task="t", job_toml="", job=spec, source="submit",
                      source_sha256="", submitted_by="test", rounds=1, state_dir="jobs/j")
        job = parse_job(spec)
        orch = Orchestrator(job, registry, initial_weights={}, plan=StatsPlan(job),
                            checkpointer=JobCheckpoint(tmp_path, store, "j"), job_id="j")

        async def site(name: str) -> None:
            node = nodes[name]
            while (task := orch.task_for(node)) is None:
                await asyncio.sleep(0.01)
            assert task.kind == pb.TASK_KIND_STATISTICS
            header = pb.UpdateHeader(node_id=node.node_id, task_id=task.task_id,
                                     round=task.round, kind=task.kind, num_examples=1,
                                     statistics_json=_doc(name))
            try:
                await ingest(orch, node, header, _receive(None), Transport.GRPC)
            except UpdateRejected as exc:
                refused.append((name, exc))

        sites = [asyncio.create_task(site(n)) for n in nodes]
        await asyncio.wait_for(orch.run(), 20)
        await asyncio.gather(*sites)
        return orch, store

    orch, store = asyncio.run(go())
    assert orch.state == RunState.FINISHED and orch.global_weights == {}
    ((name, exc),) = refused
    assert name == "evil" and exc.reason == Reject.MALFORMED and "count" in exc.message
    (rec,) = orch.history.dicts()
    stats = rec["statistics"]
    assert sorted(stats["sites"]) == ["a", "b"] and rec["rejected"][0]["node"] == "evil"
    both = np.concatenate(list(DATA.values()))
    assert stats["combined"]["x"]["count"] == both.size
    assert stats["combined"]["x"]["mean"] == pytest.approx(both.mean(), rel=1e-12)
    assert stats["combined"]["x"]["std"] == pytest.approx(both.std(), rel=1e-10)
    assert stats["release"]["min_count"] == 1
    # One round, stored with its figures (what `job status` reads after a restart).
    row = store.get("j")
    assert row is not None and row.rounds_done == 1
    saved = store.history("j")
    assert saved is not None and saved.records[0]["statistics"] == stats
