"""Ids given by a unique prefix: every command that takes a job id takes the first few
characters `fedgpu job list` shows, as git takes a short commit hash."""

from __future__ import annotations

import re
from collections.abc import Iterable

from fedgpu.cli.common.connect import Target
from fedgpu.core import admin_client
from fedgpu.core.errors import ConfigError

# What tables show of an id: unique in practice (48 bits), and an 80-column table keeps room.
SHOWN = 12
# A whole job id as the aggregator makes it (6 random bytes in hex).
FULL_JOB_ID = re.compile(r"[0-9a-f]{12}")


def short(ident: str | None) -> str:
    return (ident or "-")[:SHOWN]


def unique_prefix(given: str, known: Iterable[str], what: str = "job",
                  listing: str = "fedgpu job list") -> str:
    """The one id in `known` that is `given` or starts with it; a ConfigError saying which
    ids it could be otherwise."""
    text = given.strip()
    ids = list(dict.fromkeys(known))
    if not text:
        raise ConfigError(f"no {what} id given; '{listing}' shows them")
    if text in ids:
        return text
    found = [i for i in ids if i.startswith(text)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConfigError(f"no {what} {text!r} on this aggregator (no {what} id starts with "
                          f"it); '{listing}' shows them")
    shown = ", ".join(sorted(found)[:5]) + (", ..." if len(found) > 5 else "")
    raise ConfigError(f"{text!r} starts {len(found)} {what} ids ({shown}): give more of it")


def job_id(conn: Target, given: str) -> str:
    """The full id of the job `given` names on the aggregator `conn`. An empty `given` stays
    empty: where the id is optional that means 'the current job'."""
    if not given:
        return given
    jobs = admin_client.query(conn.address, conn.token, "ListJobs", tls=conn.tls)
    known = [j["job_id"] for j in jobs]
    whole = given.strip()
    if FULL_JOB_ID.fullmatch(whole) and whole not in known:
        # A researcher's list holds only their studies' jobs: a whole id that is not listed
        # goes to the aggregator, whose answer says why (not theirs, or no such job), rather
        # than a 'no job' here that hides a refusal.
        return whole
    return unique_prefix(given, known)
