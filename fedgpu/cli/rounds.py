"""`fedgpu rounds`: per-round metrics of a job on a running aggregator."""

from __future__ import annotations

from typing import Any

import typer

from fedgpu.cli.common import ids
from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import (
    answer,
    device_time_line,
    fmt_value,
    new_table,
    print_table,
)
from fedgpu.cli.status import JobOpt


@connection_options
def rounds(conn: Target, as_json: AsJson = False, job: JobOpt = "") -> None:
    """Per-round metrics: training loss, federated evaluation, nodes reporting.

    Example: fedgpu rounds --job 3f2a --json
    """
    answer(conn, "ListRounds", as_json, show_rounds, job_id=ids.job_id(conn, job))


def show_rounds(doc: dict[str, Any]) -> None:
    table = new_table("round", "status", "nodes", "train loss", "eval loss", "accuracy", "seconds")
    for r in doc["rounds"]:
        ev = r["eval"] or {}
        table.add_row(str(r["round"]), r["status"], str(r["nodes_reporting"]),
                      fmt_value(r["train_loss"]), fmt_value(ev.get("loss")),
                      fmt_value(ev.get("accuracy")), fmt_value(r["duration_s"], 1))
    print_table(table)
    hours = device_time_line(doc.get("device_seconds"))
    if hours:
        typer.echo(hours)
    from fedgpu.cli.secagg_rounds import lines

    for line in lines(doc):
        typer.echo(line)
    from fedgpu.cli import link_lines

    for line in link_lines.lines(doc):
        typer.echo(line)
