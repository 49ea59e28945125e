"""What leaves a site in the clear under each protection mode: every field of a real upload.

Threat model: an aggregator that reads everything a site sends. Under secure aggregation it
must learn no number about one site (training loss, examples, steps, examples/s, the
evaluation of the model it received): they travel masked and come out as sums. Under local or
distributed DP no statistic computed before the noise may leave the site. The uploads here are
built by the node's own code (node/messages.py's update_header, and node/secagg.py's
take_part against the fake aggregator of test_secagg_hostile.py), with the numbers a round
worker reports; every field that is set on each header is checked against the allow-list of
its mode (node/clear_fields.py), not only the metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from google.protobuf.message import Message

from fedgpu.node import clear_fields, messages
from fedgpu.node.secagg import Link, take_part
from fedgpu.node.unmask_ledger import UnmaskLedger
from fedgpu.proto import pb
from tests.unit.test_secagg_hostile import FakeAggregator

# A round worker's result with every number it may report (runner.py, the tasks, local DP).
RESULT: dict[str, Any] = {
    "num_examples": 321, "num_eval_examples": 45,
    "train_metrics": {"loss": 0.731, "examples": 321.0, "steps": 17.0, "examples_per_s": 812.5,
                      "ldp_update_norm": 3.25, "ldp_clipped": 1.0, "ldp_noise_std": 0.9,
                      "dp_epsilon": 1.5, "dp_delta": 1e-5, "dp_noise_multiplier": 1.1,
                      "update_bytes": 4096.0},
    "eval_metrics": {"loss": 0.612, "accuracy": 0.875},
    "iteration_loss": [0.9, 0.8],
}
USED = {"device": "cpu", "rss_peak_mib": 300, "train_seconds": 0.4, "round_seconds": 0.9}
# Not statistics of the site's data: who and which round, the payload's size and digest,
# the device it ran on and what it used (see docs/explanation/secure-aggregation.md).
ENVELOPE = {"node_id", "task_id", "round", "kind", "evaluated_round", "payload_size",
            "payload_sha256", "payload_digest", "payload_digest_algorithm", "resources",
            "decision"}
PRIVATE_VALUES = {0.731, 321.0, 17.0, 812.5, 3.25, 0.612, 0.875, 45.0}


def _fields(header: pb.UpdateHeader) -> dict[str, Any]:
    """Every field set on `header`: scalars by value, maps as dicts, messages as such."""
    out: dict[str, Any] = {}
    for desc, value in header.ListFields():
        if desc.message_type is not None and desc.message_type.GetOptions().map_entry:
            out[desc.name] = dict(value)
        elif isinstance(value, Message):
            out[desc.name] = value
        else:
            out[desc.name] = list(value) if isinstance(value, Iterable) and not isinstance(
                value, str | bytes) else value
    return out


def _check(header: pb.UpdateHeader, metrics_allowed: frozenset[str],
           extra: frozenset[str] = frozenset()) -> dict[str, Any]:
    fields = _fields(header)
    unexpected = set(fields) - ENVELOPE - extra - {"train_metrics"}
    assert not unexpected, (unexpected, fields)
    assert set(fields.get("train_metrics", {})) <= metrics_allowed, fields
    # No number of the site's data hides in the envelope's numbers either.
    for name in ("evaluated_round", "payload_size"):
        assert fields.get(name) not in PRIVATE_VALUES, (name, fields)
    return fields


def test_plain_and_central_dp_uploads_are_not_restricted() -> None:
    # Central DP trusts the aggregator with the update itself (documented): all goes.
    task = pb.TaskHeader(task_id="t", round=1, kind=pb.TASK_KIND_TRAIN)
    header = messages.update_header(task, "n", None, USED, RESULT, "")
    assert clear_fields.allowed(task) is None
    assert header.train_metrics["loss"] == 0.731 and header.num_examples == 321


def test_local_dp_upload_carries_no_pre_noise_statistic() -> None:
    task = pb.TaskHeader(task_id="t", round=1, kind=pb.TASK_KIND_TRAIN,
                         privacy_local=pb.PrivacyLocalDp(clip_norm=0.7, noise_multiplier=1.1))
    header = messages.update_header(task, "n", None, USED, RESULT, "")
    # The example count weighs the noised update (a plain round's weight, stated at
    # registration); the evaluation is of the received model on the held-out split.
    fields = _check(header, clear_fields.LOCAL_DP,
                    frozenset({"num_examples", "eval_metrics", "num_eval_examples"}))
    assert set(fields["train_metrics"]) == {"ldp_noise_std", "dp_epsilon", "dp_delta",
                                            "dp_noise_multiplier", "update_bytes"}
    assert "iteration_loss" not in fields


def _secure(distributed: bool) -> tuple[FakeAggregator, list[pb.UpdateHeader]]:
    fake = FakeAggregator(n=3, metrics=True)
    task = fake.task()
    if distributed:
        task.privacy_distributed.CopyFrom(pb.PrivacyDistributedDp(clip_norm=0.1,
                                                                   noise_multiplier=0.01))
    header = messages.update_header(task, "node-1", None, USED, RESULT, "")
    link = Link(fake, "node-1", 1, 1 << 20, lambda: fake.abandoned,  # type: ignore[arg-type]
                UnmaskLedger(None))
    why = asyncio.run(asyncio.wait_for(take_part(
        link, task, header, fake.changes[1], 321.0, None, messages.masked_values(RESULT)),
        30))
    assert why is None, why
    return fake, fake.pushed


def test_secure_aggregation_uploads_carry_nothing_per_site() -> None:
    fake, pushed = _secure(distributed=False)
    assert len(pushed) == 4  # keys, shares, the masked input, the unmask reply
    for header in pushed:
        _check(header, frozenset())
    # What the masked input carried came out as sums only (sites 2 and 3 reported none).
    assert fake.outcome is not None
    m = fake.outcome.metrics
    assert m["loss"]["sites"] == 1 and abs(m["loss"]["value"] - 0.731) < 1e-6
    assert (m["examples"]["value"], m["steps"]["value"]) == (321, 17)
    assert m["num_eval_examples"]["value"] == 45
    assert abs(m["eval_accuracy"]["value"] - 0.875) < 1e-6


def test_distributed_dp_uploads_carry_only_the_noise_std() -> None:
    fake, pushed = _secure(distributed=True)
    for header in pushed:
        fields = _check(header, clear_fields.SECURE_AGGREGATION)
        if header.kind == pb.TASK_KIND_SECAGG_MASKED_INPUT:
            assert set(fields["train_metrics"]) == {"ddp_noise_std"}
    assert fake.outcome is not None
    # No training number in the sum either: only the held-out evaluation.
    assert set(fake.outcome.metrics) == {"eval_loss", "eval_accuracy", "num_eval_examples"}
