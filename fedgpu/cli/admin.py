"""`fedgpu status|nodes|rounds|health`: questions for a running aggregator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fedgpu.cli.report import fmt_value
from fedgpu.cli.tls_options import Address, AsJson, OperatorToken, TlsCa, TlsCert, TlsKey
from fedgpu.core import admin_client, jsondoc
from fedgpu.core.tls import TlsFiles, from_options

Token = OperatorToken
JobOpt = Annotated[str, typer.Option(
    "--job", help="A job's id ('fedgpu job list'); default: the running job, else the last.")]


def status(address: Address = "localhost:50051", token: Token = None, as_json: AsJson = False,
           tls_cert: TlsCert = None, tls_key: TlsKey = None, tls_ca: TlsCa = None,
           watch: Annotated[bool, typer.Option(
               "--watch", help="Then follow the run round by round until it ends (Ctrl-C "
               "stops); with --json, one status document per line on every change.")] = False,
           interval: Annotated[float, typer.Option(
               min=0.2, help="Seconds between polls with --watch.")] = 2.0,
           job: JobOpt = "") -> None:
    """The current job's run: state, round, nodes, latest global accuracy."""
    if watch:
        from fedgpu.cli.watch import watch_status
        from fedgpu.core.lifetime import restore_ctrl_c

        # A watch runs until Ctrl-C, even when started with SIGINT ignored (a script's `&`).
        restore_ctrl_c()

        return watch_status(address, token, from_options(tls_cert, tls_key, tls_ca), as_json,
                            interval, _show_status, job)
    _answer(address, token, "GetStatus", from_options(tls_cert, tls_key, tls_ca), as_json,
            _show_status, job_id=job)


def _answer(address: str, token: str | None, method: str, tls: TlsFiles | None, as_json: bool,
            show: Callable[[dict[str, Any]], None], **fields: Any) -> None:
    """Ask the aggregator once; print its JSON as is, or `show` it for people."""
    doc = admin_client.query(address, token, method, tls=tls, **fields)
    if as_json:
        typer.echo(jsondoc.dumps(doc, indent=2))
    else:
        show(doc)


def _show_status(doc: dict[str, Any]) -> None:
    cur = doc["current_round"]
    lines = [
        f"job {doc.get('job_id') or '-'}  run {doc['run_id']}  state {doc['state']}  "
        f"task {doc['task']}  "
        f"strategy {doc['strategy']}",
        f"round {doc['round']}/{doc['rounds']}  nodes {doc['nodes']['alive']} alive of "
        f"{doc['nodes']['registered']}  accuracy {fmt_value(doc['accuracy'])}  "
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


def nodes(address: Address = "localhost:50051", token: Token = None, as_json: AsJson = False,
          tls_cert: TlsCert = None, tls_key: TlsKey = None, tls_ca: TlsCa = None) -> None:
    """Registered nodes, their GPU decision and last round's memory."""
    _answer(address, token, "ListNodes", from_options(tls_cert, tls_key, tls_ca), as_json,
            _show_nodes)


def _show_nodes(doc: dict[str, Any]) -> None:
    table = Table("name", "state", "device", "gpu", "reason", "rounds", "mem before/peak/after",
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
    Console().print(table)


def _via(n: dict[str, Any]) -> str:
    """How the node's weights move: the bulk port, or gRPC (and why, when it fell back)."""
    if n.get("bulk_error"):
        return f"grpc (bulk port unreachable: {n['bulk_error']})"
    return n.get("transport") or "-"


def rounds(address: Address = "localhost:50051", token: Token = None, as_json: AsJson = False,
           tls_cert: TlsCert = None, tls_key: TlsKey = None, tls_ca: TlsCa = None,
           job: JobOpt = "") -> None:
    """Per-round metrics: training loss, federated evaluation, nodes reporting."""
    _answer(address, token, "ListRounds", from_options(tls_cert, tls_key, tls_ca), as_json,
            _show_rounds, job_id=job)


def _show_rounds(doc: dict[str, Any]) -> None:
    table = Table("round", "status", "nodes", "train loss", "eval loss", "accuracy", "seconds")
    for r in doc["rounds"]:
        ev = r["eval"] or {}
        table.add_row(str(r["round"]), r["status"], str(r["nodes_reporting"]),
                      fmt_value(r["train_loss"]), fmt_value(ev.get("loss")),
                      fmt_value(ev.get("accuracy")), fmt_value(r["duration_s"], 1))
    Console().print(table)
    from fedgpu.cli.secagg_rounds import lines

    for line in lines(doc):
        typer.echo(line)


def health(address: Address = "localhost:50051",
           service: Annotated[str, typer.Option(help="Service name; empty = server.")] = "",
           tls_cert: TlsCert = None, tls_key: TlsKey = None, tls_ca: TlsCa = None) -> None:
    """Exit 0 when the aggregator's gRPC health service answers SERVING."""
    state = admin_client.health(address, service, tls=from_options(tls_cert, tls_key, tls_ca))
    typer.echo(state)
    raise typer.Exit(0 if state == "SERVING" else 1)


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("nodes")(nodes)
    app.command("rounds")(rounds)
    app.command("health")(health)
