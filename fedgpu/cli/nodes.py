"""`fedgpu nodes` (the nodes registered with a running aggregator, and those of its last run
that have not come back: `lost`) and `fedgpu nodes forget` (retire one)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import answer, fmt_value, new_table, print_json, print_table
from fedgpu.core import admin_client


@connection_options
def nodes(conn: Target, as_json: AsJson = False) -> None:
    """Registered nodes, their GPU decision and last round's memory; a node that stopped, or has
    not come back since the aggregator restarted, is `lost` with its last-seen time (UTC);
    `fedgpu nodes forget NODE` retires one.

    Example: fedgpu nodes --json
    """
    answer(conn, "ListNodes", as_json, show_nodes)


@connection_options
def forget(conn: Target,
           name: Annotated[str, typer.Argument(
               metavar="NODE", help="The node's name or id, as 'fedgpu nodes --json' lists "
               "them, or a unique prefix of one.")],
           force: Annotated[bool, typer.Option(
               "--force", help="Also a node still alive: it is told it is retired and "
               "exits.")] = False,
           as_json: AsJson = False) -> None:
    """Retire a node: its record goes, and the node may not register again under its identity
    (a live one, with --force, exits at once; a lost one is refused, and exits, when it comes
    back). Restarting the aggregator never retires a node; only this and 'fedgpu server stop
    --retire-nodes' do.

    Example: fedgpu nodes forget node-cpu-3
    """
    doc = admin_client.query(conn.address, conn.token, "ForgetNode", tls=conn.tls,
                             name=name, force=force)
    if as_json:
        print_json(doc)
    else:
        typer.echo(f"retired node {doc['forgotten']} (id {doc['node_id']}): it exits when it "
                   "next reaches the aggregator")


def show_nodes(doc: dict[str, Any]) -> None:
    # Short columns that never wrap, the decision's free text last where it may: 80 columns.
    table = new_table("name", "state", "device", "rounds", "mem MiB", "via", "gpu decision")
    for column in table.columns[:-1]:
        column.no_wrap = True
    table.columns[-1].ratio = 1
    notes = []
    for n in doc["nodes"]:
        d = n["gpu_decision"] or {}
        r = n["last_resources"] or {}
        # NVML memory before/peak/after the last round; a CPU round's peak RSS.
        mem = "/".join(fmt_value(r.get(k), 0) for k in
                       ("nvml_used_before_mib", "nvml_used_peak_mib", "nvml_used_after_mib"))
        if r and r.get("device") == "cpu":
            mem = f"rss {fmt_value(r.get('rss_peak_mib'), 0)}"
        decision = ": ".join(x for x in (d.get("gpu_name"), d.get("reason")) if x) or "-"
        via = n.get("transport") or "-"
        if n.get("bulk_error"):
            via = "grpc*"
            notes.append(f"* {n['name']}: bulk port unreachable ({n['bulk_error']}), weights "
                         "move over gRPC")
        state = n["state"]
        if state == "lost" and n.get("last_seen_at"):
            state = f"lost {_since(n['last_seen_at'])}"
        table.add_row(n["name"], state, d.get("device", "-"),
                      str(n["rounds_completed"]), mem if r else "-", via, decision)
    print_table(table)
    for note in notes:
        typer.echo(note)


def _since(at: float) -> str:
    """When a lost node was last seen, in UTC: the time today, the date before."""
    then = time.gmtime(at)
    return time.strftime("%H:%M" if then[:3] == time.gmtime()[:3] else "%Y-%m-%d", then)
