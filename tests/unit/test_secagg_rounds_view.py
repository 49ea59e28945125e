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
