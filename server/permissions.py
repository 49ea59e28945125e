"""What each role may do, call by call: one pure table the Admin service and the dashboard
both ask (docs/explanation/security.md lists it for people).

Reads of the federation (nodes, the status without a job) are open to every role. Reads of a
job are open to admins and viewers, and to researchers for the jobs of their own studies.
Acting on a job (stop, download its model) is for admins, and for researchers on their own
studies' jobs; submitting for admins, and for researchers naming one of their studies.
Managing nodes, people and studies is for admins only; the list of studies is open to
every role. A job that names no study is seen by admins and
viewers and acted on by admins only.
"""

from __future__ import annotations

from typing import Any

from fedgpu.core.people import Person, PersonRole

# The calls, by what they touch.
FEDERATION_READS = frozenset({"ListNodes", "ListStudies"})
JOB_READS = frozenset({"GetStatus", "ListRounds", "GetJob", "JobLogs", "ListJobs"})
JOB_ACTS = frozenset({"StopJob", "DownloadModel"})
SUBMITS = frozenset({"SubmitJob"})
ADMIN_ONLY = frozenset({"ForgetNode", "AddUser", "ListUsers", "RevokeUser", "GetAudit",
                        "StopServer", "CreateStudy", "EnrolSites", "WithdrawSites",
                        "RemoveStudy"})
CALLS = FEDERATION_READS | JOB_READS | JOB_ACTS | SUBMITS | ADMIN_ONLY


def job_study(job: Any) -> str | None:
    """The study a job belongs to: its `study` attribute (a parsed job) or the stored job's
    `study` key; None when it names none (jobs from before studies existed, and every job
    until the job file has the key)."""
    value = getattr(job, "study", None)
    if value is None:
        spec = getattr(job, "job", None)
        if isinstance(spec, dict):
            value = spec.get("study")
    return value if isinstance(value, str) and value else None


def may_read_job(person: Person, study: str | None) -> bool:
    if person.role is not PersonRole.RESEARCHER:
        return True
    return study is not None and study in person.studies


def may_act_on_job(person: Person, study: str | None) -> bool:
    if person.role is PersonRole.ADMIN:
        return True
    return person.role is PersonRole.RESEARCHER and study is not None and \
        study in person.studies


def refusal(person: Person, call: str, study: str | None = None,
            has_job: bool = True) -> str | None:
    """Why `person` may not make `call` (on a job of `study`); None when they may. `has_job`
    False: the call names no existing job (nothing to check per study)."""
    role = person.role
    who = f"{person.name} ({role})"
    if call in ADMIN_ONLY:
        return None if role is PersonRole.ADMIN else f"{who} may not {call}: admins only"
    if call in FEDERATION_READS or (call in JOB_READS and not has_job):
        return None
    if call in JOB_READS:
        return None if may_read_job(person, study) else _not_theirs(who, study)
    if call in JOB_ACTS:
        if role is PersonRole.VIEWER:
            return f"{who} may not {call}: viewers read only"
        if not has_job or may_act_on_job(person, study):
            return None
        return _not_theirs(who, study)
    if call in SUBMITS:
        if role is PersonRole.VIEWER:
            return f"{who} may not submit jobs: viewers read only"
        if role is PersonRole.ADMIN or not has_job:
            return None
        if study is None:
            return (f"{who} submits jobs of their studies only: the job names no study "
                    f"(theirs: {', '.join(person.studies) or 'none'})")
        return None if study in person.studies else _not_theirs(who, study)
    return f"{who} may not {call}: no rule allows it"


def _not_theirs(who: str, study: str | None) -> str:
    if study is None:
        return f"{who}: this job names no study; only admins act on such jobs"
    return f"{who}: this job belongs to study {study!r}, not one of theirs"
