"""Two node agents on one host, as the docs' "run the parts yourself" starts them (no
--name): each gets a name of its own from the shared state directory and both stay
registered; a third under a live node's name is refused and exits saying why; an operator
removes a lost node with `fedgpu nodes forget` (the Admin call behind it)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from fedgpu.core import admin_client
from fedgpu.core.errors import FedgpuError
from tests.fixtures.federation import Federation, base_env


def _node(federation: Federation, label: str, data: Path, state: Path, *extra: str):
    return federation.spawn(label, ["node", "start", "--aggregator", federation.address,
                                    "--data", str(data), "--torch-threads", "1",
                                    "--no-prestart", *extra],
                            env=base_env(FEDGPU_TOKEN=federation.token,
                                         FEDGPU_NODE_STATE=str(state)))


def _names(federation: Federation) -> dict[str, bool]:
    return {n["name"]: n["alive"] for n in federation.query("ListNodes")["nodes"]}


def _wait(cond, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.3)
    raise AssertionError("condition never held")


def test_two_unnamed_agents_on_one_host_keep_two_names(
        federation: Federation, digits_split: list[Path], tmp_path: Path) -> None:
    federation.start_server(None, "--heartbeat-s", "1")
    state = tmp_path / "node-state"
    a = _node(federation, "a", digits_split[0], state)
    b = _node(federation, "b", digits_split[1], state)
    host = socket.gethostname()
    _wait(lambda: len(_names(federation)) == 2)
    names = _names(federation)
    assert all(n.startswith(f"{host}-") for n in names), names
    # No eviction loop: the same two records stay, alive, and neither agent re-registers.
    first = {n["name"]: n["node_id"] for n in federation.query("ListNodes")["nodes"]}
    time.sleep(4)
    assert {n["name"]: n["node_id"] for n in federation.query("ListNodes")["nodes"]} == first
    assert all(_names(federation).values())
    assert "registering again" not in a.text() + b.text()

    # A third agent claiming a live node's name, from another state directory (another
    # identity), is refused and ends with the reason.
    taken = next(iter(first))
    c = _node(federation, "c", digits_split[2], tmp_path / "other-state", "--name", taken,
              "--connect-timeout", "20")
    assert c.popen.wait(timeout=60) != 0
    assert "held by a live node" in c.text() and f"fedgpu nodes forget {taken}" in c.text()
    assert {n["name"]: n["node_id"] for n in federation.query("ListNodes")["nodes"]} == first

    # The first agent stops; once lost, the operator forgets it.
    a.stop()
    _wait(lambda: not all(_names(federation).values()), timeout=30)
    lost = [n for n, alive in _names(federation).items() if not alive]
    assert len(lost) == 1
    with pytest.raises(FedgpuError, match="no node called"):
        federation.query("ForgetNode", name="nobody")
    doc = federation.query("ForgetNode", name=lost[0])
    assert doc["forgotten"] == lost[0]
    assert list(_names(federation)) == [n for n in first if n != lost[0]]
    # A live one is kept unless forced.
    live = next(iter(_names(federation)))
    with pytest.raises(FedgpuError, match="alive"):
        federation.query("ForgetNode", name=live)


def test_only_an_operator_may_forget_a_node(federation: Federation) -> None:
    federation.start_server(None)
    with pytest.raises(FedgpuError):
        admin_client.query(federation.address, federation.token, "ForgetNode", name="x")
