"""The table of people (server/people.py) and the role rules (server/permissions.py) as plain
data: what the integration tests drive over the wire, here with every branch."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.people import Person, PersonRole
from fedgpu.server import permissions
from fedgpu.server.people import PEOPLE_DB, People, PeopleError


def test_tokens_are_kept_only_as_digests_and_revocation_survives_reopening(
        tmp_path: Path) -> None:
    people = People(tmp_path)
    person, token = people.add("rob", PersonRole.RESEARCHER, ["onco"], by="ada")
    assert token and person.studies == ("onco",) and person.created_by == "ada"
    assert people.by_token(token) == person
    people.close()
    raw = sqlite3.connect(tmp_path / PEOPLE_DB).execute("SELECT * FROM people").fetchall()
    assert token not in repr(raw)
    people = People(tmp_path)
    people.revoke("rob")
    people.close()
    people = People(tmp_path)
    again = people.by_token(token)
    assert again is not None and again.revoked
    with pytest.raises(PeopleError, match="already revoked"):
        people.revoke("rob")
    # Re-adding issues a new token; the old one stays dead.
    _, new = people.add("rob", PersonRole.VIEWER)
    assert new != token and people.by_token(new).role is PersonRole.VIEWER  # type: ignore
    assert people.by_token(token) is None
    with pytest.raises(PeopleError, match="exists"):
        people.add("rob", PersonRole.ADMIN)
    with pytest.raises(PeopleError, match="no user"):
        people.revoke("nobody")
    with pytest.raises(ConfigError, match="name"):
        people.add("../etc", PersonRole.ADMIN)


def test_job_study_reads_what_is_there_and_none_otherwise() -> None:
    assert permissions.job_study(SimpleNamespace(job={"task": "digits"})) is None
    assert permissions.job_study(SimpleNamespace(job={"study": "onco"})) == "onco"
    assert permissions.job_study(SimpleNamespace(study="cardio", job={})) == "cardio"
    assert permissions.job_study(SimpleNamespace(job={"study": 3})) is None
    assert permissions.job_study(None) is None


@pytest.mark.parametrize(("role", "study", "expected"), [
    (PersonRole.ADMIN, None, True), (PersonRole.RESEARCHER, "onco", True),
    (PersonRole.RESEARCHER, "cardio", False), (PersonRole.RESEARCHER, None, False),
    (PersonRole.VIEWER, "onco", False),
])
def test_who_may_submit(role: PersonRole, study: str | None, expected: bool) -> None:
    person = Person("p", role, ("onco",))
    assert (permissions.refusal(person, "SubmitJob", study) is None) is expected


def test_an_unknown_call_is_refused() -> None:
    assert permissions.refusal(Person("a", PersonRole.ADMIN), "DropEverything") is not None
