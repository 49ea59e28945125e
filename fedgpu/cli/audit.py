"""`fedgpu audit show|verify`: read and check a hash-chained audit log (fedgpu.core.audit).

The aggregator writes STATE_DIR/audit.jsonl (its --state-dir), a site writes one in the node's
state directory (--state-dir, FEDGPU_NODE_STATE). With --file or --state-dir these commands
read the files where they are (a log copied elsewhere is checked the same way); without, they
ask the aggregator of the connection (an admin's credential: the Admin call GetAudit) and
check the chain of what it sent here.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import new_table, print_table
from fedgpu.core.errors import ConfigError, FedgpuError

FileOpt = Annotated[Path | None, typer.Option(
    "--file", help="The log file (its rotated files FILE.1, FILE.2, ... are read too).")]
StateDirOpt = Annotated[Path | None, typer.Option(
    "--state-dir", help="An aggregator's --state-dir or a node's state directory: the log is "
                        "DIR/audit.jsonl.")]
_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# Records fetched from an aggregator at most (a few hundred MB of JSON).
MAX_REMOTE = 1_000_000


def _path(file: Path | None, state_dir: Path | None) -> Path | None:
    """The local log, or None: ask the aggregator."""
    from fedgpu.core.audit import AUDIT_FILE

    if file is not None and state_dir is not None:
        raise ConfigError("give the log with --file PATH or --state-dir DIR, not both")
    if file is None and state_dir is None:
        return None
    path = file if file is not None else state_dir / AUDIT_FILE  # type: ignore[operator]
    if not path.exists() and not list(path.parent.glob(path.name + ".*")):
        raise ConfigError(f"no audit log at {path}")
    return path


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """An ISO date or time (UTC unless it says), or a duration back from now (30m, 2h, 7d)."""
    now = now or dt.datetime.now(dt.UTC)
    match = _DURATION.match(text.strip())
    if match:
        return now - dt.timedelta(seconds=int(match[1]) * _UNITS[match[2]])
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"--since {text!r}: give an ISO time (2026-11-26T18:00) or a "
                          "duration (30m, 2h, 7d)") from None
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def _fetch(conn: Target) -> list[dict[str, Any]]:
    """Every record of the aggregator's log, page by page (bounded: MAX_REMOTE records)."""
    from fedgpu.core import admin_client

    records: list[dict[str, Any]] = []
    after = -1
    while len(records) < MAX_REMOTE:
        doc = admin_client.query(conn.address, conn.token, "GetAudit", tls=conn.tls,
                                 after_seq=after, timeout=60)
        records += doc["records"]
        if doc.get("next_seq") is None:
            return records
        after = int(doc["next_seq"])
    raise FedgpuError(f"the aggregator's audit log has more than {MAX_REMOTE} records: read "
                      "it on its host with --state-dir")


def _time(record: dict[str, Any]) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(str(record.get("time")))
    except ValueError:
        return None


@connection_options
def show(
    conn: Target,
    file: FileOpt = None,
    state_dir: StateDirOpt = None,
    since: Annotated[str | None, typer.Option(
        help="Only records from then on: an ISO time (UTC unless it says) or a duration "
             "back from now (30m, 2h, 7d).")] = None,
    as_json: AsJson = False,
) -> None:
    """The audit log's records, oldest first: when, who, what, on what, how it ended.

    Example: fedgpu audit show --state-dir state --since 1h
    """
    from fedgpu.core import audit

    path = _path(file, state_dir)
    start = parse_since(since) if since else None
    source = audit.read(path) if path is not None else _fetch(conn)
    records = [r for r in source
               if start is None or ((t := _time(r)) is not None and t >= start)]
    if as_json:
        typer.echo(json.dumps(records, indent=2))
        return
    if not records:
        typer.echo(f"no audit records in {path or conn.address}" + (f" since {start.isoformat()}"
                                                    if start else ""))
        return
    table = new_table("time", "actor", "action", "target", "outcome")
    for r in records:
        table.add_row(str(r.get("time", "?"))[:23], str(r.get("actor", "?")),
                      str(r.get("action", "?")), str(r.get("target", "")),
                      str(r.get("outcome", "")))
    print_table(table)


@connection_options
def verify(
    conn: Target,
    file: FileOpt = None,
    state_dir: StateDirOpt = None,
    head: Annotated[str | None, typer.Option(
        help="A head hash exported earlier: the log must still hold that record (a log cut "
             "at a record boundary is only caught this way).")] = None,
    as_json: AsJson = False,
) -> None:
    """Check the audit log's hash chain: exits 1 and names the first bad line if a record
    was edited, deleted, inserted or moved, or the last line is torn. Prints the head hash:
    keep it elsewhere and pass it back with --head.

    Example: fedgpu audit verify --state-dir state
    """
    from fedgpu.core import audit

    path = _path(file, state_dir)
    if path is not None:
        verdict = audit.verify(path, head=head)
    else:
        # Checked here, from the records: not the aggregator's word for it.
        verdict = audit.verify_records(_fetch(conn), f"aggregator {conn.address}", head)
    if as_json:
        typer.echo(json.dumps(verdict.to_dict(), indent=2))
        if not verdict.ok:
            raise typer.Exit(1)
        return
    if verdict.problem is not None:
        err = FedgpuError(f"audit log broken at {verdict.problem} ({verdict.records} "
                          "record(s) before it check out)")
        err.exit_code = 1
        raise err
    typer.echo(f"ok: {verdict.records} record(s) in {len(verdict.files)} file(s); "
               f"head {verdict.head}")
