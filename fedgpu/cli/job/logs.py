"""`fedgpu job logs`: the aggregator's events for a job, and the errors its nodes reported."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from fedgpu.cli.common import ids
from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import print_json, when
from fedgpu.cli.job.options import JobId
from fedgpu.core import admin_client


def event_line(e: dict[str, Any]) -> str:
    who = e["source"] + (f" {e['node']}" if e.get("node") else "")
    return f"{when(e['time'])} {e['level']:<7} {who}: {e['message']}"


@connection_options
def logs(conn: Target, job_id: JobId,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new "
                                              "events until the job ends (Ctrl-C stops).")]
         = False,
         as_json: AsJson = False) -> None:
    """The aggregator's events for a job and the errors its nodes reported.

    Example: fedgpu job logs 3f2a --follow
    """
    events = admin_client.job_logs(conn.address, conn.token, ids.job_id(conn, job_id),
                                   follow=follow, tls=conn.tls)
    if as_json and not follow:
        print_json(list(events))
        return
    for event in events:
        typer.echo(json.dumps(event) if as_json else event_line(event))
