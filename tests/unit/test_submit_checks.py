"""A submitted job is checked against the federation as it is: a task no registered node offers
(no built-in, no bundle) is refused with a "did you mean"; with no node registered yet, it is
queued and waits."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedgpu.core.bundles import open_archive, pack_files
from fedgpu.core.constants import BUILTIN_TASKS
from fedgpu.core.errors import ConfigError
from fedgpu.server.jobs.queue import JobManager
from fedgpu.server.jobs.store import JobStore
from fedgpu.server.registry import Registry


def _manager(tmp_path: Path, *tasks: list[str]) -> JobManager:
    registry = Registry()
    for i, offered in enumerate(tasks):
        registry.register(name=f"n{i}", peer="p", version="t", devices={}, decision={},
                          labels={}, tasks=offered)
    return JobManager(JobStore(tmp_path), registry, tmp_path, chunk_size=1 << 20)


def test_a_typo_is_refused_with_the_task_it_resembles(tmp_path: Path) -> None:
    jobs = _manager(tmp_path, ["digits", "faulty"])
    with pytest.raises(ConfigError, match=r"task 'digitz'.*did you mean 'digits'"):
        jobs.intake.submit('task = "digitz"\n', "job.toml", "operator")
    assert jobs.store.jobs(limit=10) == []  # nothing queued
    # What a node offers, and the built-in tasks, are accepted.
    assert jobs.intake.submit('task = "faulty"\n', "job.toml", "operator").task == "faulty"
    assert jobs.intake.submit('task = "images"\n', "job.toml", "operator").task == "images"


def test_with_no_node_registered_any_task_waits(tmp_path: Path) -> None:
    jobs = _manager(tmp_path)
    assert jobs.intake.submit('task = "mine"\n', "job.toml", "operator").state == "queued"


def test_a_bundle_brings_its_own_task(tmp_path: Path) -> None:
    jobs = _manager(tmp_path, ["digits"])
    data = pack_files({"fedgpu-task.toml": b'name = "mytask"\nentry = "m:T"\n',
                       "m.py": b"class T:\n    name = 'mytask'\n"})
    row = jobs.intake.submit('task_dir = "x"\n', "job.toml", "operator", bundle=open_archive(data))
    assert row.task == "mytask"


def test_the_aggregator_knows_the_nodes_built_in_tasks() -> None:
    from fedgpu.node.tasks import _BUILTIN

    assert sorted(_BUILTIN) == sorted(BUILTIN_TASKS)


def test_a_node_that_lists_no_tasks_takes_any(tmp_path: Path) -> None:
    jobs = _manager(tmp_path, ["digits"], [])
    assert jobs.intake.submit('task = "synthetic"\n', "job.toml", "operator").task == "synthetic"
