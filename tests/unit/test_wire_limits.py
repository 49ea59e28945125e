"""Bounds on what the wire may leave in the aggregator, and the documents it serves."""

from __future__ import annotations

import json

import pytest

from fedgpu.core import jsondoc
from fedgpu.proto import pb
from fedgpu.server.registry import Registry, RegistryFull
from fedgpu.server.rejections import Reject
from fedgpu.server.transfer import wire_limits
from fedgpu.server.views import paging


def test_error_text_is_truncated_with_a_marker_and_escaped() -> None:
    assert wire_limits.truncate("fine") == "fine"
    out = wire_limits.truncate("x" * 5000)
    assert out == "x" * 4096 + " [truncated: 5000 characters in all]"
    assert wire_limits.truncate("a\nb\x1b[0m") == "a\\nb\\x1b[0m"


def test_headers_with_unbounded_or_non_finite_fields_are_refused() -> None:
    ok = pb.UpdateHeader(node_id="n", task_id="t", train_metrics={"loss": 1e308})
    wire_limits.check_update_header(ok)
    for header, words, reason in [
        (pb.UpdateHeader(train_metrics={"loss": float("nan")}), "is nan", Reject.NON_FINITE),
        (pb.UpdateHeader(eval_metrics={"a": float("inf")}), "is inf", Reject.NON_FINITE),
        (pb.UpdateHeader(iteration_loss=[1.0, float("nan")]), "NaN", Reject.NON_FINITE),
        (pb.UpdateHeader(resources=pb.RoundResources(train_seconds=float("inf"))),
         "train_seconds is inf", Reject.NON_FINITE),
        (pb.UpdateHeader(train_metrics={f"m{i}": 1.0 for i in range(65)}), "65 entries",
         Reject.MALFORMED),
        (pb.UpdateHeader(task_id="t" * 2000), "task_id is 2000 characters",
         Reject.MALFORMED),
        (pb.UpdateHeader(node_id="a\nb"), "control", Reject.MALFORMED),
    ]:
        with pytest.raises(wire_limits.WireError, match=words) as err:
            wire_limits.check_update_header(header)
        assert err.value.reason == reason
    long_error = pb.UpdateHeader(failed=True, error="e" * 10_000)
    wire_limits.check_update_header(long_error)  # kept, but cut
    assert long_error.error.endswith("[truncated: 10000 characters in all]")


def test_replaced_nodes_are_dropped_and_the_registry_is_bounded() -> None:
    now = [1000.0]
    reg = Registry(heartbeat_interval_s=5, clock=lambda: now[0], max_nodes=3)
    for _ in range(40):
        reg.register("same", "peer", "0", {}, {}, {"k": "v" * 256}, [])
    assert len(reg) == 1 and [n.name for n in reg.all()] == ["same"]
    reg.register("b", "peer", "0", {}, {}, {}, [])
    reg.register("c", "peer", "0", {}, {}, {}, [])
    with pytest.raises(RegistryFull, match="3 nodes are registered and alive"):
        reg.register("d", "peer", "0", {}, {}, {}, [])
    now[0] += 10
    reg.touch(next(n.node_id for n in reg.all() if n.name == "b"))
    reg.touch(next(n.node_id for n in reg.all() if n.name == "c"))
    now[0] += 10  # "same" is now lost (last seen 20 s ago), b and c are alive
    reg.register("d", "peer", "0", {}, {}, {}, [])
    assert sorted(n.name for n in reg.all()) == ["b", "c", "d"] and len(reg) == 3


def test_documents_are_strict_json_with_a_count_of_nulls() -> None:
    text = jsondoc.dumps({"a": float("nan"), "b": [1.0, float("inf")], "c": "x"})
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": "x", "non_finite_values": 2}
    assert jsondoc.dumps({"a": 1.5}) == '{"a": 1.5}'


def test_pages_fit_their_budget_and_join_into_the_whole_list() -> None:
    items = [{"round": i, "blob": "x" * 300, "updates": []} for i in range(50)]
    joined: list[dict] = []
    offset: int | None = 0
    pages = 0
    while offset is not None:
        text = paging.page({"run_id": "r"}, "rounds", items, offset, budget=2000)
        assert len(text) <= 2100
        doc = json.loads(text)
        assert doc["run_id"] == "r"
        joined += doc["rounds"]
        offset = doc.get("next_offset")
        pages += 1
    assert joined == items and pages > 5
    big = {"round": 1, "updates": [{"n": "u" * 100} for _ in range(100)], "failures": []}
    (shrunk,) = json.loads(paging.page({}, "rounds", [big], 0, budget=3000))["rounds"]
    assert 0 < len(shrunk["updates"]) < 100
    assert shrunk["updates_not_listed"] == 100 - len(shrunk["updates"])
    nan = json.loads(paging.page({}, "rounds", [{"x": float("nan")}], 0))
    assert nan == {"rounds": [{"x": None}], "non_finite_values": 1}
