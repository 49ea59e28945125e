"""What a rounds document says as MLflow metrics and parameters (server/tracking/)."""

from __future__ import annotations

import math

from fedgpu.server.tracking.round_metrics import params, points


def _update(node: str, loss: float, peak: int | None) -> dict:
    return {"node": node, "node_id": f"{node}-x", "train_metrics": {"loss": loss},
            "resources": {"nvml_used_peak_mib": peak, "rss_peak_mib": 300,
                          "train_seconds": 0.5}}


def _doc() -> dict:
    return {
        "initial_eval": {"loss": 2.3, "accuracy": 0.1, "per_node": []},
        "rounds": [
            {"round": 1, "attempt": 1, "status": "retried", "train_loss": 9.0, "updates": []},
            {"round": 1, "attempt": 2, "status": "finished", "train_loss": 1.5,
             "duration_s": 0.4, "num_examples": 100, "nodes_reporting": 2,
             "privacy": {"epsilon": 0.7},
             "updates": [_update("site a", 1.4, 812), _update("b", float("nan"), None)],
             "eval": {"loss": 0.5, "accuracy": 0.8, "per_node": [
                 {"node": "site a", "metrics": {"accuracy": 0.9}},
                 {"node": "b", "metrics": {"accuracy": 0.7}}]}},
            # Under secure aggregation the aggregator holds no per-site numbers.
            {"round": 2, "attempt": 1, "status": "finished", "train_loss": 1.1,
             "updates": []},
        ],
    }


def test_points_come_from_finished_attempts_at_their_round() -> None:
    got = {(k, s): v for k, v, s in points(_doc())}
    assert got[("eval_accuracy", 0)] == 0.1
    assert got[("train_loss", 1)] == 1.5 and got[("train_loss", 2)] == 1.1
    assert 9.0 not in got.values()  # the retried attempt is not a step of the model
    assert got[("epsilon", 1)] == 0.7
    assert got[("site.site a.train_loss", 1)] == 1.4
    assert got[("site.site a.gpu_peak_mib", 1)] == 812
    assert got[("site.b.eval_accuracy", 1)] == 0.7 and got[("eval_loss", 1)] == 0.5


def test_nothing_is_invented_or_non_finite() -> None:
    got = points(_doc())
    assert all(math.isfinite(v) for _, v, _ in got)
    assert not any(k.startswith("site.b.train_loss") for k, _, _ in got)
    assert not any(k.startswith("site.b.gpu") for k, _, _ in got)
    assert not any(k.startswith("site.") for k, _, s in got if s == 2)


def test_keys_are_safe_and_params_flat() -> None:
    doc = _doc()
    doc["rounds"][1]["updates"][0]["node"] = "weird:name*1"
    assert any(k == "site.weird_name_1.train_loss" for k, _, _ in points(doc))
    flat = params({"task": "digits", "rounds": 5, "initial_weights": None,
                   "privacy": {"mode": "central", "target_epsilon": 8.0},
                   "strategy_params": {}})
    assert flat == {"task": "digits", "rounds": "5", "privacy.mode": "central",
                    "privacy.target_epsilon": "8.0"}
