"""`fedgpu nodes`: the nodes registered with a running aggregator."""

from __future__ import annotations

from typing import Any

from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import answer, fmt_value, new_table, print_table


@connection_options
def nodes(conn: Target, as_json: AsJson = False) -> None:
    """Registered nodes, their GPU decision and last round's memory.

    Example: fedgpu nodes --json
    """
    answer(conn, "ListNodes", as_json, show_nodes)


def show_nodes(doc: dict[str, Any]) -> None:
    table = new_table("name", "state", "device", "gpu", "reason", "rounds", "mem before/peak/after",
                  "weights via")
    for n in doc["nodes"]:
        d = n["gpu_decision"] or {}
        r = n["last_resources"] or {}
        mem = "/".join(fmt_value(r.get(k)) for k in
                       ("nvml_used_before_mib", "nvml_used_peak_mib", "nvml_used_after_mib"))
        if r and r.get("device") == "cpu":
            mem = f"rss {fmt_value(r.get('rss_peak_mib'))}"
        table.add_row(n["name"], n["state"], d.get("device", "-"),
                      d.get("gpu_name") or "-", d.get("reason", "-"),
                      str(n["rounds_completed"]), mem if r else "-", _via(n))
    print_table(table)


def _via(n: dict[str, Any]) -> str:
    """How the node's weights move: the bulk port, or gRPC (and why, when it fell back)."""
    if n.get("bulk_error"):
        return f"grpc (bulk port unreachable: {n['bulk_error']})"
    return n.get("transport") or "-"
