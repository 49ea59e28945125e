"""People who operate a federation, and what each role may do.

Three roles (DESIGN.md "A consortium on one federation"):

- `admin`: manages people, acts on every job and node;
- `researcher`: submits, follows, stops and downloads the models of the jobs of their own
  studies, and reads the federation's state;
- `viewer`: reads, acts on nothing (no submit, stop, download, forget, users).

The aggregator's table of people decides a person's role; a certificate's subject only names
the person. Shared by the aggregator (which enforces) and the CLI (which validates names and
roles before asking).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from fedgpu.core.errors import ConfigError

# A person's or a study's name: what a certificate's CN, a log line and a URL carry safely.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
MAX_STUDIES = 64
# A study's name: the same rule (the job file's `study` key checks it too).
STUDY_NAME = _NAME


class PersonRole(StrEnum):
    ADMIN = "admin"
    RESEARCHER = "researcher"
    VIEWER = "viewer"


def check_name(name: str, what: str = "user") -> str:
    if not _NAME.match(name):
        raise ConfigError(f"{what} name {name[:80]!r} must be 1-64 characters: letters, digits "
                          "and . _ @ -, starting with a letter or digit")
    return name


def check_studies(studies: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    if len(studies) > MAX_STUDIES:
        raise ConfigError(f"at most {MAX_STUDIES} studies per person")
    return tuple(dict.fromkeys(check_name(s, "study") for s in studies))


@dataclass(frozen=True)
class Person:
    """Who is calling, as the aggregator decided it. `implicit`: the single operator
    credential of before people existed (--operator-token, an operator certificate not in the
    table), which acts as an admin so nothing that worked stops working."""

    name: str
    role: PersonRole
    studies: tuple[str, ...] = ()
    implicit: bool = False
    credential: str = "token"  # token | certificate
    created_at: float | None = None
    created_by: str | None = None
    revoked_at: float | None = None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": str(self.role), "studies": list(self.studies),
                "credential": self.credential, "created_at": self.created_at,
                "created_by": self.created_by, "revoked_at": self.revoked_at,
                "revoked": self.revoked}
