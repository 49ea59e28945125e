"""`fedgpu rounds` under the table: a secure round's masked, dropped and recovered sites, or
why it failed, in one line."""

from __future__ import annotations


def test_rounds_lines_say_what_happened() -> None:
    from fedgpu.cli.secagg_rounds import lines

    doc = {"rounds": [
        {"round": 1, "attempt": 1, "secure_aggregation": {
            "sites": 4, "failed": {"stage": "share-keys", "reason": "2 sites left"}}},
        {"round": 1, "attempt": 2, "secure_aggregation": {
            "sites": 4, "masked": 3, "dropped": {"masked-input": ["b"]}, "recovered": 1,
            "protocol_s": 1.25}},
        {"round": 2, "attempt": 1},
    ]}
    assert lines(doc) == [
        "round 1 attempt 1, secure aggregation: failed at share-keys: 2 sites left",
        "round 1 attempt 2, secure aggregation: 3 of 4 sites masked, dropped b at masked-input, "
        "1 recovered, protocol 1.2s",
    ]


SUMS = {"loss": {"value": 0.41, "sites": 3}, "examples": {"value": 1200, "sites": 3},
        "steps": {"value": 40, "sites": 3}, "examples_per_s": {"value": 950.25, "sites": 3}}


def test_the_sums_of_the_masked_numbers_are_shown_wherever_rounds_are() -> None:
    from fedgpu.cli.job.status import masked_line
    from fedgpu.cli.secagg_rounds import lines
    from fedgpu.server.views.dashboard_pages import round_summary

    rec = {"round": 4, "attempt": 1, "status": "finished", "train_loss": 0.41,
           "num_examples": 1200, "masked_metrics": SUMS,
           "secure_aggregation": {"sites": 3, "masked": 3, "protocol_s": 0.5}}
    # fedgpu rounds: the loss is the table's column, the other sums under it.
    assert lines({"rounds": [rec]}) == [
        "round 4 attempt 1, secure aggregation: 3 of 3 sites masked, protocol 0.5s; sums of "
        "the masked metrics: 1,200 examples, 40 steps, 950.2 examples/s"]
    # fedgpu job status (server/views/documents.py's last_masked_metrics feeds it).
    assert masked_line({"round": 4, **{k: v["value"] for k, v in SUMS.items()}}) == (
        "round 4 (sums of the sites' masked numbers): train loss 0.4100, 1,200 examples, "
        "40 steps, 950.2 examples/s")
    # The dashboard's round summary.
    sa = round_summary(rec)["secure_aggregation"]
    assert sa["sums"] == {"loss": 0.41, "examples": 1200, "steps": 40, "examples_per_s": 950.25}
    assert round_summary({**rec, "masked_metrics": None})["secure_aggregation"]["sums"] is None
