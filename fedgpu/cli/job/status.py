"""`fedgpu job status`: one job, its open round and each node's part in it."""

from __future__ import annotations

from typing import Any

import typer

from fedgpu.cli.common import ids
from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.cross_site_text import matrix_lines
from fedgpu.cli.common.evaluation import site_lines
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import (
    device_time_line,
    fmt_value,
    new_table,
    print_json,
    print_table,
)
from fedgpu.cli.job.options import JobId
from fedgpu.cli.job.statistics_text import statistics_lines
from fedgpu.core import admin_client


@connection_options
def status(conn: Target, job_id: JobId, as_json: AsJson = False) -> None:
    """One job: its state, the open round, and each node's part in it (or why not).

    Example: fedgpu job status 3f2a
    """
    doc = admin_client.query(conn.address, conn.token, "GetJob", tls=conn.tls,
                             job_id=ids.job_id(conn, job_id))
    if as_json:
        print_json(doc)
        return
    lines = [f"job {doc['job_id']} ({doc['name']}, task {doc['task']}): {doc['state']}"
             + (f" — {doc['reason']}" if doc["reason"] else ""),
             f"rounds {doc['rounds_done']}/{doc['rounds']}  accuracy "
             f"{fmt_value(doc['accuracy'])}  loss {fmt_value(doc['loss'])}"]
    if doc.get("bundle_sha256"):
        lines.append(f"task bundle {doc['bundle_name']!r}: sha256 {doc['bundle_sha256']} "
                     f"({doc['bundle_size']:,} bytes)")
    cur = doc.get("current_round")
    if cur:
        lines.append(f"open: round {cur['round']} ({cur['kind']}, attempt {cur['attempt']}) "
                     f"{cur['accepted']}/{cur['participants']} updates, deadline in "
                     f"{cur['deadline_in_s']}s")
    if doc.get("privacy"):
        p = doc["privacy"]
        budget = f" of {p['target_epsilon']:g}" if p["target_epsilon"] is not None else ""
        lines.append(f"privacy ({p['mode']}): epsilon {fmt_value(p['epsilon_spent'])}{budget} "
                     f"spent at delta {p['delta']:g} over {p['rounds_accounted']} round(s)")
    if doc.get("masked_metrics"):
        lines.append(masked_line(doc["masked_metrics"]))
    if doc.get("evaluation"):
        lines.append("evaluation of the job's model on each site's held-out data:")
        lines += site_lines(doc["evaluation"])
    lines += statistics_lines(doc.get("statistics"))
    lines += matrix_lines(doc.get("cross_site"))
    hours = device_time_line(doc.get("device_seconds"))
    if hours:
        lines.append(hours)
    if doc["error"]:
        lines.append(f"error: {doc['error']}")
    typer.echo("\n".join(lines))
    if doc.get("nodes"):
        table = new_table("node", "state", "taking part", "why not")
        for n in doc["nodes"]:
            table.add_row(n["name"], n["state"], "yes" if n["eligible"] else "no",
                          n["reason"] or "")
        print_table(table)


def masked_line(m: dict[str, Any]) -> str:
    """`round 4 (sums of the sites' masked numbers): train loss 0.4121, 1,200 examples, 40
    steps, 950.3 examples/s`."""
    parts = [f"train loss {fmt_value(m['loss'])}"] if m.get("loss") is not None else []
    for key, label, fmt in (("examples", "examples", "{:,.0f}"), ("steps", "steps", "{:,.0f}"),
                            ("examples_per_s", "examples/s", "{:,.1f}")):
        if m.get(key) is not None:
            parts.append(f"{fmt.format(m[key])} {label}")
    return f"round {m['round']} (sums of the sites' masked numbers): {', '.join(parts)}"
