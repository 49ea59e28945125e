"""`fedgpu job list`: every job on the aggregator, oldest first."""

from __future__ import annotations

from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.ids import short
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import fmt_value, new_table, print_json, print_table, when
from fedgpu.core import admin_client


@connection_options
def list_jobs(conn: Target, as_json: AsJson = False) -> None:
    """Every job, oldest first: state, progress, latest accuracy.

    Example: fedgpu job list
    """
    doc = admin_client.query(conn.address, conn.token, "ListJobs", tls=conn.tls)
    if as_json:
        print_json(doc)
        return
    table = new_table("job", "name", "task", "state", "rounds", "acc", "loss", "submitted",
                      "note", ids=1)
    for j in doc:
        table.add_row(short(j["job_id"]), j["name"], j["task"], j["state"],
                      f"{j['rounds_done']}/{j['rounds']}", fmt_value(j["accuracy"], 3),
                      fmt_value(j["loss"], 3), when(j["submitted_at"], short=True),
                      j["error"] or j["reason"] or "")
    print_table(table)
