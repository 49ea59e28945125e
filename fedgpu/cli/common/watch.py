"""`fedgpu status --watch`: follow a run round by round until it ends (or Ctrl-C)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import typer

from fedgpu.core import admin_client, jsondoc
from fedgpu.core.constants import RUN_ENDED as ENDED
from fedgpu.core.errors import FedgpuError


def _num(v: Any, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def round_line(rec: dict[str, Any], total: int) -> str:
    verb = "finished" if rec["status"] == "finished" else f"{rec['status']} (attempt " \
        f"{rec['attempt']}, {rec['nodes_reporting']} updates were too few)"
    return (f"round {rec['round']}/{total} {verb}: {rec['nodes_reporting']} nodes, train loss "
            f"{_num(rec['train_loss'])}, {_num(rec['duration_s'], 1)}s"
            + (f", aggregation {_num(rec.get('aggregation_s'), 3)}s"
               if rec.get("aggregation_s") is not None else ""))


def eval_line(rec: dict[str, Any]) -> str:
    ev = rec["eval"]
    return (f"round {rec['round']} global model: accuracy {_num(ev.get('accuracy'))}, loss "
            f"{_num(ev.get('loss'))} on {ev.get('nodes')} nodes")


def watch_status(address: str, token: str | None, tls: Any, as_json: bool,
                 interval: float, show: Callable[[dict[str, Any]], None],
                 job_id: str = "") -> None:
    """Prints the status once, then each round as it closes (its federated evaluation when
    it arrives) and every change of state; returns when the run has ended. The exit code is
    0 for a finished run and 1 for a failed or stopped one."""
    def query(method: str) -> dict[str, Any]:
        return admin_client.query(address, token, method, tls=tls, job_id=job_id)

    status = query("GetStatus")  # unreachable at the start: the usual one-line error
    if as_json:
        typer.echo(jsondoc.dumps(status))
    else:
        show(status)
    printed: set[tuple[int, int]] = set()
    evaluated: set[int] = set()
    # Rounds that closed before we started are part of the status already shown.
    for rec in query("ListRounds")["rounds"]:
        printed.add((rec["round"], rec["attempt"]))
        if rec.get("eval"):
            evaluated.add(rec["round"])
    state, lost_since = status["state"], None
    while state not in ENDED:
        time.sleep(interval)
        try:
            status, rounds = query("GetStatus"), query("ListRounds")["rounds"]
        except FedgpuError as exc:
            # An aggregator restarting from its checkpoint comes back: keep watching.
            if lost_since is None:
                print(f"{exc}; still watching (Ctrl-C to stop)", file=sys.stderr)
                lost_since = time.monotonic()
            continue
        if lost_since is not None:
            print(f"aggregator at {address} is back (run {status['run_id']})", file=sys.stderr)
            lost_since = None
        changed = False
        # Nodes send round r's evaluation with their round r+1 updates, one by one: it is
        # complete once a later round has closed, or the run (and its final evaluation) ended.
        last_closed = max((rec["round"] for rec in rounds), default=0)
        for rec in rounds:
            key = (rec["round"], rec["attempt"])
            if key not in printed:
                printed.add(key)
                changed = True
                if not as_json:
                    typer.echo(round_line(rec, status["rounds"]))
            complete = rec["round"] < last_closed or status["state"] in ENDED
            if complete and rec.get("eval") and rec["eval"].get("accuracy") is not None \
                    and rec["round"] not in evaluated and rec["status"] == "finished":
                evaluated.add(rec["round"])
                changed = True
                if not as_json:
                    typer.echo(eval_line(rec))
        if status["state"] != state:
            changed = True
            if not as_json:
                typer.echo(f"state {state} -> {status['state']}"
                           + (f": {status['error']}" if status.get("error") else ""))
            state = status["state"]
        if as_json and changed:
            typer.echo(jsondoc.dumps(status))
    if not as_json:
        typer.echo(f"run {status['run_id']} {state}: round {status['round']}/{status['rounds']}"
                   f", accuracy {_num(status['accuracy'])}")
    raise typer.Exit(0 if state == "finished" else 1)
