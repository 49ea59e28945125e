"""A site's own policy (fedgpu/core/site_policy.py) and its check in the node agent
(node/site_rules.py), without processes: the file's strict parsing, each key refusing and
allowing, the terms a real parsed job and a real task header carry, the GPU time a site counts
per job, and the site audit records of refusals.

Threat model (docs/explanation/security.md, "Site policies"): the site enforces its policy
itself; the aggregator's copy is advisory. The node reads the task it would run (its name,
bundle and round) from the task itself, checks that a training task of a job claiming secure
aggregation carries the protocol's setup, and counts its own GPU time: an aggregator that
lies about those cannot make the site train. The job's study and central DP settings are the
aggregator's word (tested here as such: a header without terms is refused outright).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from fedgpu.core import audit
from fedgpu.core.constants import TaskApproval
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.core.site_policy import (
    JobTerms,
    SitePolicy,
    from_json,
    load,
    parse,
    refuses_study,
    stricter_approval,
    terms_of,
)
from fedgpu.core.site_policy_wire import terms_from_header, terms_to_wire
from fedgpu.node.site_rules import SiteRules
from fedgpu.proto import pb

FULL = """
studies = ["onco", "cardio"]
tasks = ["digits", "BUNDLE"]
task_approval = "approved"
require_secure_aggregation = true
max_epsilon = 8.0
max_rounds = 50
max_gpu_hours = 10
hours = "20:00-06:00"
timezone = "Europe/Berlin"
""".replace("BUNDLE", "ab" * 32)

GOOD = JobTerms(job_id="j1", study="onco", task="digits", rounds=20, secure_aggregation=True,
                dp_mode="central", target_epsilon=4.0)
# 23:00 in Berlin (UTC+1 in November): inside 20:00-06:00.
NIGHT = dt.datetime(2026, 11, 26, 22, 0, tzinfo=dt.UTC)
NOON = dt.datetime(2026, 11, 26, 11, 0, tzinfo=dt.UTC)


def test_a_full_policy_parses_and_reads_back_from_what_it_advertises(tmp_path: Path) -> None:
    (tmp_path / "policy.toml").write_text(FULL)
    p = load(tmp_path / "policy.toml")
    assert p.studies == ("onco", "cardio") and p.task_approval is TaskApproval.APPROVED
    assert (p.max_epsilon, p.max_rounds, p.max_gpu_hours) == (8.0, 50, 10.0)
    assert p.hours is not None and p.hours.text() == "20:00-06:00 Europe/Berlin"
    # The aggregator reads the advertised JSON with the same strict parser: the same policy.
    assert from_json(p.to_json(), "advertised") == p
    assert from_json("", "advertised") is None
    assert p.digest() == from_json(p.to_json(), "x").digest()  # type: ignore[union-attr]
    assert p.refusals(GOOD, NIGHT) == []
    assert SitePolicy().refusals(JobTerms(task="x"), NOON) == []  # no policy: no conditions


@pytest.mark.parametrize(("text", "message"), [
    ("max_round = 3", "unknown key 'max_round' (did you mean 'max_rounds'?)"),
    ("studys = ['a']", "(did you mean 'studies'?)"),
    ("studies = 'onco'", "studies must be a list of names"),
    ("studies = ['']", "studies must be a list of names"),
    ("task_approval = 'aproved'", "(did you mean 'approved'?)"),
    ("require_secure_aggregation = 'yes'", "must be true or false"),
    ("max_epsilon = 0", "max_epsilon must be a number above 0"),
    ("max_epsilon = nan", "max_epsilon must be a number above 0"),
    ("max_rounds = 2.5", "max_rounds must be a whole number"),
    ("max_rounds = true", "max_rounds must be a whole number"),
    ("max_gpu_hours = -1", "max_gpu_hours must be a number above 0"),
    ("hours = '8-18'", "hours must be a daily window \"HH:MM-HH:MM\""),
    ("hours = '08:00-08:00'", "is an empty window"),
    ("hours = '08:00-18:00'\ntimezone = 'Mars/Olympus'", "unknown timezone 'Mars/Olympus'"),
    ("timezone = 'UTC'", "timezone is the zone of `hours`"),
    ("studies = [", "not valid TOML"),
])
def test_a_policy_file_with_a_mistake_is_refused_with_the_key_and_the_fix(
        text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(text, "policy.toml")
    assert message in str(err.value) and str(err.value).startswith("policy.toml: ")


def test_limits_bound_what_a_policy_and_its_advertised_copy_may_hold(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at most 1000 names"):
        names = ", ".join(f'"s{i}"' for i in range(1001))
        parse(f"studies = [{names}]")
    with pytest.raises(ConfigError, match="over 65536 bytes"):
        parse("# " + "x" * (64 << 10))
    with pytest.raises(ConfigError, match="not JSON"):
        from_json("{", "node a")
    with pytest.raises(ConfigError, match="cannot read the site policy"):
        load(tmp_path / "missing.toml")


@pytest.mark.parametrize(("policy", "refused", "allowed", "reason"), [
    ("studies = ['onco']", JobTerms(study="cardio"), JobTerms(study="onco"),
     "the job names study 'cardio'; this site serves 'onco'"),
    ("studies = ['onco']", JobTerms(), JobTerms(study="onco"), "the job names no study"),
    ("tasks = ['digits']", JobTerms(task="cifar"), JobTerms(task="digits"),
     "task 'cifar' is not among the site's tasks ('digits')"),
    (f"tasks = ['{'cd' * 32}']", JobTerms(task="mine", bundle_sha256="ef" * 32),
     JobTerms(task="mine", bundle_sha256="cd" * 32), "task 'mine' (bundle efefefefefef)"),
    ("require_secure_aggregation = true", JobTerms(), JobTerms(secure_aggregation=True),
     "the site requires secure_aggregation = true"),
    ("max_epsilon = 8", JobTerms(), JobTerms(dp_mode="local", target_epsilon=8.0),
     "requires differential privacy ([privacy] with target_epsilon <= 8)"),
    ("max_epsilon = 8", JobTerms(dp_mode="central"), JobTerms(dp_mode="central",
                                                               target_epsilon=1.0),
     "requires differential privacy"),
    ("max_epsilon = 8", JobTerms(dp_mode="central", target_epsilon=9.5),
     JobTerms(dp_mode="central", target_epsilon=7.9),
     "target_epsilon = 9.5 is over the site's maximum 8"),
    ("max_rounds = 10", JobTerms(rounds=11), JobTerms(rounds=10),
     "rounds = 11 is over the site's maximum 10 per job"),
])
def test_each_key_refuses_a_job_that_breaks_it_and_allows_one_that_keeps_it(
        policy: str, refused: JobTerms, allowed: JobTerms, reason: str) -> None:
    p = parse(policy)
    why = p.refusals(refused, NOON)
    assert len(why) == 1 and reason in why[0], why
    assert p.refusals(allowed, NOON) == []


def test_the_round_the_gpu_time_and_the_hours_are_checked_where_they_are_known() -> None:
    p = parse("max_rounds = 3\nmax_gpu_hours = 2\nhours = '20:00-06:00'\n"
              "timezone = 'Europe/Berlin'")
    job = JobTerms(rounds=3)
    assert p.refusals(job, NIGHT, gpu_hours_spent=1.99, round_number=3) == []
    # A lying aggregator's job with rounds = 3 still asks for round 4: the node counts.
    assert p.refusals(job, NIGHT, round_number=4) == [
        "round 4 is past the site's maximum 3 per job"]
    assert p.refusals(job, NIGHT, gpu_hours_spent=2.0) == [
        "the site has spent 2 GPU-hours on this job, its maximum is 2"]
    assert p.refusals(job, NOON) == ["the site trains only 20:00-06:00 Europe/Berlin"]
    # Past midnight, and the window's end is exclusive (05:00 UTC = 06:00 Berlin).
    assert p.refusals(job, dt.datetime(2026, 11, 27, 4, 59, tzinfo=dt.UTC)) == []
    assert p.refusals(job, dt.datetime(2026, 11, 27, 5, 0, tzinfo=dt.UTC)) != []
    # "Would it ever take it" (submit's question): the hours are not held against it.
    assert p.refusals(job, None) == []
    day = parse("hours = '08:00-18:00'")  # UTC by default
    assert day.refusals(job, NOON) == [] and day.refusals(job, NIGHT) != []


def test_a_site_joins_only_the_studies_its_policy_serves() -> None:
    assert refuses_study(None, "onco") is None
    assert refuses_study(parse("max_rounds = 3"), "onco") is None
    assert refuses_study(parse("studies = ['onco']"), "onco") is None
    assert refuses_study(parse("studies = ['onco']"), "cardio") == (
        "site policy: this site serves 'onco', not study 'cardio'")


def test_the_file_can_only_narrow_the_nodes_task_approval() -> None:
    assert stricter_approval(TaskApproval.ANY, TaskApproval.APPROVED) is TaskApproval.APPROVED
    assert stricter_approval(TaskApproval.APPROVED, TaskApproval.ANY) is TaskApproval.APPROVED
    assert stricter_approval(TaskApproval.APPROVED, TaskApproval.INSTALLED) \
        is TaskApproval.INSTALLED
    assert stricter_approval(TaskApproval.ANY, None) is TaskApproval.ANY


def test_a_parsed_job_and_its_task_header_carry_the_same_terms() -> None:
    job = parse_job({"task": "digits", "rounds": 7, "min_nodes": 3, "secure_aggregation": True,
                     "privacy": {"mode": "distributed", "clip_norm": 1.0,
                                 "noise_multiplier": 1.0, "target_epsilon": 6.0}})
    terms = terms_of(job, "job42", "ab" * 32)
    assert terms == JobTerms(job_id="job42", task="digits", bundle_sha256="ab" * 32,
                             rounds=7, secure_aggregation=True, dp_mode="distributed",
                             target_epsilon=6.0)
    plain = terms_of(parse_job({"task": "digits"}))
    assert (plain.secure_aggregation, plain.dp_mode, plain.target_epsilon) == (False, "", None)
    header = pb.TaskHeader(task_name="digits", round=2, job_terms=terms_to_wire(terms),
                           bundle=pb.TaskBundle(sha256="ab" * 32))
    # Through the wire bytes, as the node gets it.
    back = terms_from_header(pb.TaskHeader.FromString(header.SerializeToString()))
    assert back == terms
    assert terms_from_header(pb.TaskHeader(task_name="digits")) is None


def _rules(tmp_path: Path, text: str | None) -> SiteRules:
    state = tmp_path / "node-state"
    return SiteRules(parse(text, "site.toml") if text is not None else None, state,
                     audit.AuditLog(state / audit.AUDIT_FILE))


def _task(kind: int = pb.TASK_KIND_TRAIN, secagg: bool = True, **terms: object
          ) -> pb.TaskHeader:
    t = {"job_id": "job1", "rounds": 3, "secure_aggregation": True, **terms}
    return pb.TaskHeader(task_name="digits", round=1, kind=kind,
                         job_terms=pb.JobTerms(**t),  # type: ignore[arg-type]
                         secagg_setup=b"setup" if secagg else b"")


def test_the_node_checks_the_task_itself_and_audits_each_refusal(tmp_path: Path) -> None:
    rules = _rules(tmp_path, "require_secure_aggregation = true\nmax_rounds = 3")
    assert rules.refusals(_task(), "train") == []
    # The terms claim secure aggregation; the training task itself is a plain round.
    assert rules.refusals(_task(secagg=False), "train") == [
        "the site requires secure aggregation and this training task is a plain round"]
    # An evaluation carries no setup in any job: the claim alone is checked.
    assert rules.refusals(_task(kind=pb.TASK_KIND_EVALUATE, secagg=False), "evaluate") == []
    # Local DP noise is added here, by settings the task must carry.
    dp = _rules(tmp_path / "dp", "max_epsilon = 8")
    local = _task(dp_mode="local", target_epsilon=4.0)
    assert dp.refusals(local, "train") == [
        "the job claims local DP and this training task carries no noise settings"]
    local.privacy_local.CopyFrom(pb.PrivacyLocalDp(clip_norm=1.0, noise_multiplier=1.0))
    assert dp.refusals(local, "train") == []
    no_terms = pb.TaskHeader(task_name="digits", round=1, kind=pb.TASK_KIND_TRAIN)
    assert "sent no job terms" in rules.refusals(no_terms, "train")[0]
    # A site without a policy takes everything, terms or none.
    assert _rules(tmp_path / "other", None).refusals(no_terms, "train") == []

    log = tmp_path / "node-state" / audit.AUDIT_FILE
    refused = [r for r in audit.read(log) if r["action"] == "policy.refused"]
    assert [r["outcome"] for r in refused] == ["REFUSED", "REFUSED"]
    assert "plain round" in refused[0]["detail"] and refused[0]["actor"] == "policy site.toml"
    assert "job job1 digits round 1" == refused[0]["target"]
    assert audit.verify(log).ok


def test_gpu_time_is_counted_per_job_across_restarts_and_refuses_past_the_maximum(
        tmp_path: Path) -> None:
    rules = _rules(tmp_path, "max_gpu_hours = 0.5")
    task = _task(secagg=True)
    rules.spent(task, {"device": "cuda", "round_seconds": 1200.0})
    rules.spent(task, {"device": "cpu", "round_seconds": 9999.0})  # not GPU time
    rules.spent(_task(job_id="other"), {"device": "cuda", "round_seconds": 3600.0})
    assert rules.refusals(task, "train") == []
    # A new agent on the same state directory (a restart) sees what the job spent.
    again = _rules(tmp_path, "max_gpu_hours = 0.5")
    assert again.gpu_hours("job1") == pytest.approx(1 / 3)
    again.spent(task, {"device": "cuda", "round_seconds": 600.0})
    assert again.refusals(task, "train") == [
        "the site has spent 0.5 GPU-hours on this job, its maximum is 0.5"]
    # Another job has a budget of its own; a job id that is no file name is hashed into one.
    assert again.refusals(_task(job_id="fresh"), "train") == []
    weird = _task(job_id="../../etc/passwd")
    again.spent(weird, {"device": "cuda", "round_seconds": 1.0})
    files = sorted(p.name for p in (tmp_path / "node-state" / "policy_usage").iterdir())
    assert len(files) == 3 and all("/" not in f and ".." not in f for f in files), files
    assert json.loads((tmp_path / "node-state" / "policy_usage" / "job1.json").read_text()
                      )["gpu_seconds"] == pytest.approx(1800.0)
