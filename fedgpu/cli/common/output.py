"""How commands print for people: values, times and tables that fit an 80-column terminal
(ids at 12 characters, never cut shorter), and JSON documents for --json."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from fedgpu.cli.common.connect import Target
from fedgpu.cli.common.ids import SHOWN
from fedgpu.core import admin_client, jsondoc


def fmt_value(v: Any, digits: int = 4) -> str:
    """A metric for a table or summary: "-" when missing, floats to `digits` places."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def device_time_line(summary: dict[str, Any] | None) -> str | None:
    """One line of a job's device time (`device_seconds` of rounds / job status), or None
    before any update counted."""
    if not summary or not summary.get("per_site"):
        return None
    sites = ", ".join(f"{site} {s / 3600:.3f}" for site, s in summary["per_site"].items())
    return f"GPU-hours (device time) {summary['total'] / 3600:.3f}: {sites}"


def when(ts: float | None, short: bool = False) -> str:
    """A local time; `short` (tables): month, day, hours and minutes."""
    if ts is None:
        return "-"
    return time.strftime("%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S", time.localtime(ts))


def print_json(doc: Any) -> None:
    typer.echo(json.dumps(doc, indent=2))


def new_table(*headers: str, ids: int = 0) -> Table:
    """A table with light rules and one space between columns; its first `ids` columns hold
    ids, which are never wrapped or cut below their 12 shown characters."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), show_edge=False)
    for i, header in enumerate(headers):
        if i < ids:
            table.add_column(header, no_wrap=True, min_width=SHOWN, max_width=SHOWN)
        else:
            table.add_column(header, overflow="fold")
    return table


def print_table(table: Table, console: Console | None = None) -> None:
    """The table if it fits the terminal (80 columns in a pipe), else one record per block of
    `header: value` lines: a folded cell ("submitt/ed") is harder to read than either."""
    console = console or Console()
    # Measured as if the terminal had no edge: the width the table wants, not the one it gets.
    if console.measure(table, options=console.options.update_width(1 << 16)).maximum \
            <= console.width:
        console.print(table)
        return
    headers = [str(col.header) for col in table.columns]
    width = max((len(h) for h in headers), default=0)
    rows = zip(*(list(col.cells) for col in table.columns), strict=True)
    for i, row in enumerate(rows):
        if i:
            console.print()
        for header, cell in zip(headers, row, strict=True):
            console.print(f"{header + ':':<{width + 1}} {cell}", soft_wrap=True, highlight=False,
                          markup=False)


def answer(conn: Target, method: str, as_json: bool, show: Callable[[dict[str, Any]], None],
           **fields: Any) -> None:
    """Ask the aggregator once; print its JSON as is, or `show` it for people."""
    doc = admin_client.query(conn.address, conn.token, method, tls=conn.tls, **fields)
    if as_json:
        typer.echo(jsondoc.dumps(doc, indent=2))
    else:
        show(doc)
