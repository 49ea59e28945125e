"""Node identity: one name per agent of a state directory, the same name and secret at every
start, and an aggregator that refuses a live name to another identity (issue: two agents on
one host evicted each other 517 times in 7 s)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from fedgpu.node import identity
from fedgpu.node.retry import Repeats
from fedgpu.server.registry import NameTaken, NotForgotten, Registry


def _register(reg: Registry, name: str, secret: str, peer: str = "ipv4:10.0.0.1:1"):
    return reg.register(name=name, peer=peer, version="t", devices={}, decision={}, labels={},
                        tasks=[], identity=secret)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_two_agents_of_one_state_dir_get_two_default_names(tmp_path: Path) -> None:
    a = identity.claim(tmp_path, None)
    b = identity.claim(tmp_path, None)
    assert a.name != b.name and a.secret != b.secret
    assert a.name.split("-")[0] == b.name.split("-")[0]  # both start with the hostname
    a.release()
    again = identity.claim(tmp_path, None)  # a restarted agent gets its name back
    assert (again.name, again.secret) == (a.name, a.secret)
    saved = a.folder / "identity.json"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    b.release()
    again.release()


def test_a_named_identity_keeps_its_secret(tmp_path: Path) -> None:
    first = identity.claim(tmp_path, "site/a")
    second = identity.claim(tmp_path, "site/a")
    assert first.name == second.name == "site/a"
    assert first.secret == second.secret and len(first.secret) == 64
    assert identity.claim(tmp_path, "site-b").secret != first.secret
    # A damaged file is a new identity, not a crash.
    (first.folder / "identity.json").write_text("{not json")
    assert identity.claim(tmp_path, "site/a").secret not in ("", first.secret)


def test_an_unwritable_state_dir_runs_without_identity(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    ident = identity.claim_or_anonymous(blocker / "state", "n1")
    assert (ident.name, ident.secret) == ("n1", "")


def test_a_live_name_is_refused_to_another_identity_and_kept_by_its_own() -> None:
    clock = Clock()
    reg = Registry(heartbeat_interval_s=5, clock=clock)
    first = _register(reg, "host-a", "s1")
    with pytest.raises(NameTaken, match="held by a live node.*fedgpu nodes forget host-a"):
        _register(reg, "host-a", "s2", peer="ipv4:10.0.0.2:1")
    assert reg.get(first.node_id) is first  # the first one is untouched
    again = _register(reg, "host-a", "s1")  # the same node, restarted: takes its name back
    assert reg.get(first.node_id) is None and reg.get(again.node_id) is again
    # Lost (no heartbeat for 3 intervals): anyone may take the name.
    clock.t += 60
    newcomer = _register(reg, "host-a", "s3")
    assert [n.node_id for n in reg.all()] == [newcomer.node_id]
    # Nodes that send no identity (older versions, simulations) replace as before.
    legacy = _register(reg, "host-a", "")
    assert [n.node_id for n in reg.all()] == [legacy.node_id]


def test_forget_removes_a_lost_node_and_a_live_one_only_with_force() -> None:
    clock = Clock()
    reg = Registry(heartbeat_interval_s=5, clock=clock)
    node = _register(reg, "gone", "s1")
    with pytest.raises(NotForgotten, match="alive"):
        reg.forget("gone")
    clock.t += 60
    assert reg.forget("gone") is node and node.gone and reg.all() == []
    with pytest.raises(NotForgotten, match="no node called"):
        reg.forget("gone")
    live = _register(reg, "live", "s2")
    reg.forget("live", force=True)
    assert reg.get(live.node_id) is None


def test_registering_again_and_again_backs_off() -> None:
    clock = Clock()
    r = Repeats(base_s=1, cap_s=8, window_s=60, clock=clock)
    delays = []
    for _ in range(6):
        delays.append(r.next_delay())
        clock.t += 0.01
    assert delays == [0, 1, 2, 4, 8, 8]
    clock.t += 61
    assert r.next_delay() == 0  # a quiet spell resets it
