"""`fedgpu status`: the current job's run on a running aggregator, once or followed."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from fedgpu.cli.common import ids
from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import WATCH_INTERVAL_S, AsJson
from fedgpu.cli.common.output import answer, fmt_value

JobOpt = Annotated[str, typer.Option(
    "--job", help="A job's id or its first characters ('fedgpu job list'); default: the "
                  "running job, else the last.")]


@connection_options
def status(conn: Target, as_json: AsJson = False,
           watch: Annotated[bool, typer.Option(
               "--watch", help="Then follow the run round by round until it ends (Ctrl-C "
               "stops); with --json, one status document per line on every change.")] = False,
           interval: Annotated[float, typer.Option(
               min=0.2, help="Seconds between polls with --watch.")] = WATCH_INTERVAL_S,
           job: JobOpt = "") -> None:
    """The current job's run: state, round, nodes, latest global accuracy.

    Examples: fedgpu status --watch; fedgpu status --connection compose --json
    """
    job = ids.job_id(conn, job)
    if watch:
        from fedgpu.cli.common.watch import watch_status
        from fedgpu.core.lifetime import restore_ctrl_c

        # A watch runs until Ctrl-C, even when started with SIGINT ignored (a script's `&`).
        restore_ctrl_c()

        return watch_status(conn.address, conn.token, conn.tls, as_json, interval,
                            show_status, job)
    answer(conn, "GetStatus", as_json, show_status, job_id=job)


def _shown(v: Any) -> str:
    # No run yet: its id, task and strategy are null in the JSON and "-" for people.
    return "-" if v is None or v == "" else fmt_value(v)


def show_status(doc: dict[str, Any]) -> None:
    cur = doc["current_round"]
    lines = [
        f"job {_shown(doc.get('job_id'))}  run {_shown(doc['run_id'])}  state {doc['state']}  "
        f"task {_shown(doc['task'])}  strategy {_shown(doc['strategy'])}",
        f"round {_shown(doc['round'])}/{_shown(doc['rounds'])}  nodes {doc['nodes']['alive']} "
        f"alive of {doc['nodes']['registered']}  accuracy {fmt_value(doc['accuracy'])}  "
        f"loss {fmt_value(doc['loss'])}",
    ]
    if cur:
        lines.append(f"open: round {cur['round']} ({cur['kind']}, attempt {cur['attempt']}) "
                     f"{cur['accepted']}/{cur['participants']} updates, deadline in "
                     f"{cur['deadline_in_s']}s")
    if doc["error"]:
        lines.append(f"error: {doc['error']}")
    up = doc.get("uploads") or {}
    if up.get("in_flight") or up.get("timed_out"):
        lines.append(f"uploads: {up['in_flight']} in flight ({up['stalled']} stalled, "
                     f"{up['waiting_for_memory']} waiting for memory), {up['timed_out']} "
                     "timed out")
    if doc["rejections"]:
        lines.append("rejected updates: " + ", ".join(
            f"{k}={v}" for k, v in doc["rejections"].items()))
    typer.echo("\n".join(lines))
