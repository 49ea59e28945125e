"""The node registry on disk (server/registry_store.py) and what the registry makes of it: a
record read back after a restart is listed as lost and never used; a retired identity is
refused its name; ids are found by unique prefix; a node is available for a round only while
its task loop polls."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fedgpu.core.job import parse_job
from fedgpu.server.registry import LOOP_GRACE_S, NotForgotten, Registry, Retired
from fedgpu.server.registry_store import FILENAME, RegistryStore
from fedgpu.server.rounds.eligibility import eligibility


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _registry(state: Path, clock: Clock) -> Registry:
    return Registry(1, clock=clock, store=RegistryStore(state))


def test_records_survive_a_restart_as_lost_with_their_last_seen_time(tmp_path: Path) -> None:
    clock = Clock()
    reg = _registry(tmp_path, clock)
    a = reg.register("site-a", "ipv4:10.0.0.1:5", "1.0", {"gpus": []}, {"device": "cpu"},
                     {"hostname": "a"}, ["digits"], identity="secret-a")
    a.rounds_completed = 4
    clock.now += 10
    reg.touch(a.node_id)
    reg.flush()

    # A new process on the same state directory, a few seconds later.
    clock.now += 3
    again = _registry(tmp_path, clock)
    [lost] = again.all()
    assert (lost.name, lost.node_id, lost.restored) == ("site-a", a.node_id, True)
    assert again.get(a.node_id) is None and not again.is_alive(lost) and again.alive() == []
    [doc] = again.snapshot()
    assert doc["state"] == "lost" and doc["alive"] is False
    assert doc["last_seen_at"] == 1_000_010.0 and doc["rounds_completed"] == 4
    assert doc["labels"] == {"hostname": "a"} and doc["gpu_decision"] == {"device": "cpu"}
    # Not a single heartbeat's worth of records: the identity stays a digest.
    raw = (tmp_path / FILENAME).read_bytes()
    assert b"secret-a" not in raw

    # It comes back: its new self replaces the record, and it is alive again.
    back = again.register("site-a", "p", "1.0", {}, {}, {}, [], identity="secret-a")
    assert [n.node_id for n in again.all()] == [back.node_id] and again.is_alive(back)


def test_a_retired_identity_is_refused_and_another_may_take_the_name(tmp_path: Path) -> None:
    clock = Clock()
    reg = _registry(tmp_path, clock)
    reg.register("site-b", "p", "1", {}, {}, {}, [], identity="b-1")
    with pytest.raises(NotForgotten, match="alive"):
        reg.forget("site-b")
    reg.forget("site-b", force=True)
    assert reg.all() == []
    # After a restart too.
    again = _registry(tmp_path, clock)
    assert again.all() == []
    with pytest.raises(Retired, match="retired by the operator.*another --name"):
        again.register("site-b", "p", "1", {}, {}, {}, [], identity="b-1")
    # A fresh install of the site (a new identity) is a new node.
    assert again.register("site-b", "p", "1", {}, {}, {}, [], identity="b-2").name == "site-b"


def test_forget_finds_a_node_by_name_id_or_unique_prefix(tmp_path: Path) -> None:
    clock = Clock()
    reg = _registry(tmp_path, clock)
    one = reg.register("site-1", "p", "1", {}, {}, {}, [])
    reg.register("site-2", "p", "1", {}, {}, {}, [])
    clock.now += 60  # both lost
    with pytest.raises(NotForgotten, match="names 2 nodes"):
        reg.forget("site-")
    with pytest.raises(NotForgotten, match="no node called"):
        reg.forget("x")
    assert reg.find(one.node_id[:-3]) is one
    assert reg.forget(one.node_id) is one
    assert reg.forget("site").name == "site-2"  # the only one left with that prefix


def test_retiring_every_node_leaves_nothing_to_list(tmp_path: Path) -> None:
    clock = Clock()
    reg = _registry(tmp_path, clock)
    reg.register("site-a", "p", "1", {}, {}, {}, [])
    reg.retire_all()
    assert _registry(tmp_path, clock).all() == []


def test_a_registry_of_a_newer_fedgpu_is_refused(tmp_path: Path) -> None:
    RegistryStore(tmp_path).close()
    db = sqlite3.connect(tmp_path / FILENAME)
    db.execute("PRAGMA user_version=99")
    db.close()
    with pytest.raises(RuntimeError, match="newer fedgpu"):
        RegistryStore(tmp_path)


def test_a_node_whose_task_loop_does_not_poll_is_not_sampled() -> None:
    import time

    reg = Registry(1)
    node = reg.register("site", "p", "1", {}, {}, {}, [])
    job = parse_job({"task": "digits"})
    assert eligibility(job, node, True) is None  # nothing known yet: it decides itself
    node.loop_seen = time.time() - LOOP_GRACE_S - 5
    why = eligibility(job, node, True)
    assert why is not None and "task loop has not asked for work" in why
    node.polling = 1  # in a long poll now
    assert eligibility(job, node, True) is None
    node.polling = 0
    node.assigned["j1"] = object()  # training a task of the open round: busy, not stuck
    assert eligibility(job, node, True) is None
    node.assigned.clear()
    node.polling, node.loop_seen = 0, time.time()
    assert eligibility(job, node, True) is None
