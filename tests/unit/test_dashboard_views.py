"""The dashboard's bounded views of the Admin documents, on plain documents."""

from __future__ import annotations

from typing import Any

import pytest

from fedgpu.server.views.dashboard_pages import (
    MAX_PAGE,
    MEMORY_ROUNDS,
    WORK_ROUNDS,
    WORK_SITES,
    NodesQuery,
    QueryError,
    RoundsQuery,
    memory_history,
    nodes_page,
    nodes_summary,
    round_summary,
    rounds_summary,
)


def node(name: str, state: str = "idle", device: str = "cpu", gpus: int = 0) -> dict[str, Any]:
    return {"node_id": f"{name}-1", "name": name, "state": state, "alive": state != "lost",
            "gpu_decision": {"device": device}, "devices": {"gpus": [{}] * gpus}}


def update(name: str, before: int | None = None, peak: int | None = None,
           after: int | None = None, upload: float | None = 0.1) -> dict[str, Any]:
    return {"node": name, "upload_s": upload,
            "resources": {"device": "cuda" if peak is not None else "cpu",
                          "nvml_used_before_mib": before, "nvml_used_peak_mib": peak,
                          "nvml_used_after_mib": after, "rss_peak_mib": 300}}


def record(number: int, updates: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"round": number, "attempt": 1, "status": "finished", "started_at": 1.0,
            "duration_s": 2.0, "participants": [u["node"] for u in updates],
            "nodes_reporting": len(updates), "dropped": [], "train_loss": 0.5,
            "num_examples": 10, "bytes_received": 100, "aggregation_s": 0.01,
            "updates": updates, "rejected": [], "failures": [], "eval": None, **extra}


def test_no_parameters_mean_the_whole_document() -> None:
    assert NodesQuery.parse({}) is None
    assert RoundsQuery.parse({}) is None


@pytest.mark.parametrize(("params", "message"), [
    ({"limit": "0"}, "limit must be between 1 and 500"),
    ({"limit": str(MAX_PAGE + 1)}, "limit must be between"),
    ({"offset": "-1"}, "offset must be between"),
    ({"offset": "ten"}, "offset must be an integer"),
    ({"q": "x" * 201}, "q is limited to 200"),
    ({"sort": "name"}, "unknown parameter 'sort'"),
])
def test_bad_node_queries_say_what_is_wrong(params: dict[str, str], message: str) -> None:
    with pytest.raises(QueryError, match=message):
        NodesQuery.parse(params)


def test_bad_round_queries_say_what_is_wrong() -> None:
    with pytest.raises(QueryError, match="last must be between"):
        RoundsQuery.parse({"summary": "1", "last": "0"})
    with pytest.raises(QueryError, match="summary takes 1"):
        RoundsQuery.parse({"summary": "full"})
    assert RoundsQuery.parse({"summary": "1", "last": "7"}) == RoundsQuery(last=7)


def test_a_page_of_sites_with_a_summary_of_all() -> None:
    nodes = [node(f"site-{i:03d}", state="lost" if i % 10 == 0 else "idle",
                  device="cuda" if i % 2 else "cpu", gpus=2 if i % 2 else 0)
             for i in range(120)]
    page = nodes_page({"nodes": nodes}, [], NodesQuery(offset=50, limit=20))
    assert [n["name"] for n in page["nodes"]] == [f"site-{i:03d}" for i in range(50, 70)]
    assert (page["total"], page["offset"], page["limit"]) == (120, 50, 20)
    assert page["summary"] == {"registered": 120, "alive": 108,
                               "states": {"idle": 108, "lost": 12},
                               "devices": {"cpu": 60, "cuda": 60}, "gpus": 120}
    # The records are the CLI's, plus their memory history.
    assert page["nodes"][0] == {**nodes[50], "memory_history": []}


def test_search_and_state_filter_before_paging() -> None:
    nodes = [node("alpha"), node("beta", "lost"), node("ALPHABET", "lost"), node("gamma")]
    page = nodes_page({"nodes": nodes}, [], NodesQuery.parse({"q": "Alpha"}))
    assert [n["name"] for n in page["nodes"]] == ["alpha", "ALPHABET"]
    page = nodes_page({"nodes": nodes}, [], NodesQuery.parse({"q": "alpha", "state": "lost"}))
    assert [n["name"] for n in page["nodes"]] == ["ALPHABET"] and page["total"] == 1
    assert page["summary"]["registered"] == 4  # the summary ignores the filter
    past_the_end = nodes_page({"nodes": nodes}, [], NodesQuery(offset=10))
    assert past_the_end["nodes"] == [] and past_the_end["total"] == 4


def test_memory_history_is_per_site_by_name_and_bounded() -> None:
    rounds = [record(r, [update("gpu-a", 100, 900 + r, 100), update("cpu-b")])
              for r in range(1, MEMORY_ROUNDS + 6)]
    hist = memory_history(rounds, {"gpu-a", "cpu-b", "absent"})
    assert [p["round"] for p in hist["gpu-a"]] == list(range(6, MEMORY_ROUNDS + 6))
    assert hist["gpu-a"][-1] == {"round": MEMORY_ROUNDS + 5, "device": "cuda", "before": 100,
                                 "peak": 900 + MEMORY_ROUNDS + 5, "after": 100,
                                 "rss_peak": 300}
    assert hist["cpu-b"][0]["peak"] is None and hist["cpu-b"][0]["rss_peak"] == 300
    assert hist["absent"] == []


def test_round_summary_counts_instead_of_lists() -> None:
    rec = record(3, [update("a", upload=0.4), update("b", upload=0.1), update("c", upload=None)],
                 dropped=["d-1"], failures=[{"node": "e"}],
                 rejected=[{"reason": "digest"}, {"reason": "late"}, {"reason": "digest"}],
                 eval={"loss": 0.4, "accuracy": 0.9, "nodes": 3, "per_node": [{}, {}, {}]})
    s = round_summary(rec)
    assert s["participants"] == 3 and s["dropped"] == 1 and s["failures"] == 1
    assert s["upload_s"] == {"max": 0.4, "median": 0.25}
    assert s["rejected"] == {"digest": 2, "late": 1}
    assert s["eval"] == {"loss": 0.4, "accuracy": 0.9, "nodes": 3}
    assert round_summary(record(4, []))["upload_s"] is None


def test_rounds_summary_keeps_the_last_records() -> None:
    doc = {"run_id": "r1", "initial_eval": {"loss": 2.3, "accuracy": 0.1, "nodes": 2,
                                            "per_node": [{}]},
           "rounds": [record(r, [update("a")]) for r in range(1, 11)]}
    s = rounds_summary(doc, RoundsQuery(last=3))
    assert s["total"] == 10 and [r["round"] for r in s["rounds"]] == [8, 9, 10]
    assert s["initial_eval"] == {"loss": 2.3, "accuracy": 0.1, "nodes": 2}
    assert s["run_id"] == "r1"


def test_summary_of_nothing() -> None:
    assert nodes_summary([]) == {"registered": 0, "alive": 0, "states": {}, "devices": {},
                                 "gpus": 0}
    assert rounds_summary({"run_id": "x", "initial_eval": None, "rounds": []},
                          RoundsQuery()) == {"run_id": "x", "initial_eval": None, "total": 0,
                                             "rounds": [], "device_seconds": None}
    # The job's GPU-hours reach the page whole, whatever the rounds shown.
    hours = {"total": 7.0, "hours": 0.0019, "per_site": {"a": 7.0}}
    assert rounds_summary({"rounds": [], "device_seconds": hours},
                          RoundsQuery())["device_seconds"] == hours


SECURE = {"sites": 4, "threshold": 3, "neighbours": 3, "protocol_s": 3.41, "ring_bits": 32,
          "max_weight": 512, "masked": 3, "dropped": {"masked-input": ["site-b"]},
          "recovered": 1, "total_weight": 1437, "unmask_s": 0.01}


def test_a_secure_round_shows_its_protocol_with_drops_counted_by_stage() -> None:
    s = round_summary(record(2, [update("a")], secure_aggregation=SECURE))
    assert s["secure_aggregation"] == {
        "sites": 4, "masked": 3, "dropped": {"masked-input": 1}, "recovered": 1,
        "protocol_s": 3.41, "unmask_s": 0.01, "ring_bits": 32, "failed": None, "sums": None}
    failed = {"sites": 3, "threshold": 2, "neighbours": 2, "protocol_s": 0.5,
              "failed": {"stage": "share-keys", "reason": "1 of 2 shareholders"}}
    f = round_summary(record(3, [], status="retried", secure_aggregation=failed))
    assert f["secure_aggregation"]["failed"] == failed["failed"]
    assert f["secure_aggregation"]["dropped"] == {} and f["secure_aggregation"]["masked"] is None
    # A plain round (and a record from before these keys) has neither.
    plain = round_summary(record(4, [update("a")]))
    assert plain["secure_aggregation"] is None and plain["work"] is None


def _worked(name: str, steps: float, examples: float) -> dict[str, Any]:
    return {**update(name), "train_metrics": {"loss": 0.3, "steps": steps,
                                              "examples": examples, "examples_per_s": 9.0}}


def test_a_time_budgeted_round_shows_each_sites_steps_and_examples() -> None:
    rec = record(5, [_worked("slow-b", 55.0, 1760.0), _worked("fast-a", 400.0, 12800.0),
                     _worked("slow-c", 60.0, 1920.0)], round_train_s=2.0)
    w = round_summary(rec)["work"]
    assert w["budget_s"] == 2.0
    assert w["sites"] == [{"node": "fast-a", "steps": 400, "examples": 12800},
                          {"node": "slow-b", "steps": 55, "examples": 1760},
                          {"node": "slow-c", "steps": 60, "examples": 1920}]
    assert w["steps"] == {"min": 55, "median": 60, "max": 400}
    assert w["examples"] == {"min": 1760, "median": 1920, "max": 12800}
    assert w["sites_not_listed"] == 0
    # Epoch rounds report steps too, but only a time budget shows them.
    assert round_summary(record(6, [_worked("a", 5.0, 50.0)]))["work"] is None


def test_work_per_site_is_bounded_in_sites_and_rounds() -> None:
    many = [_worked(f"site-{i:04d}", 10.0 + i, 100.0) for i in range(WORK_SITES + 7)]
    w = round_summary(record(1, many, round_train_s=1.0))["work"]
    assert len(w["sites"]) == WORK_SITES and w["sites_not_listed"] == 7
    assert w["steps"]["max"] == 10 + WORK_SITES + 6  # the spread counts every site
    doc = {"run_id": "r", "initial_eval": None,
           "rounds": [record(r, [_worked("a", 3.0, 30.0)], round_train_s=1.0)
                      for r in range(1, WORK_ROUNDS + 11)]}
    rounds = rounds_summary(doc, RoundsQuery(last=WORK_ROUNDS + 5))["rounds"]
    listed = [r["round"] for r in rounds if r["work"]["sites"]]
    assert listed == list(range(11, WORK_ROUNDS + 11))  # the newest WORK_ROUNDS
    assert all(r["work"]["steps"] == {"min": 3, "median": 3, "max": 3} for r in rounds)
