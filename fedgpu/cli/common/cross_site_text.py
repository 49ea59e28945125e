"""A cross-site job's site x model matrix as text (`fedgpu job status`, `fedgpu run`, the
report's markdown), from the "cross_site" document of `job status --json`: one row per model
(the training job's global model, then each site's local model), one column per site whose
held-out data scored it, accuracy in each cell; a model or a cell missing is marked and its
reason listed under the table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# A terminal shows this many sites as columns; --json has them all.
SHOWN_SITES = 12


def _cell(cell: Mapping[str, Any] | None, notes: list[str], where: str) -> str:
    if not cell or cell.get("why_not"):
        notes.append(f"{where}: {(cell or {}).get('why_not') or 'not scored'}")
        return f"[{len(notes)}]"
    acc = cell.get("accuracy")
    return f"{acc:.4f}" if isinstance(acc, int | float) else "-"


def matrix_rows(doc: Mapping[str, Any]) -> tuple[list[list[str]], list[str]]:
    """The table (a header row, then one row per model) and the numbered notes."""
    sites = list(doc.get("sites") or ())[:SHOWN_SITES]
    table = [["model \\ data", *sites, "weighted"]]
    notes: list[str] = []
    for row in doc.get("rows") or ():
        name = row.get("model")
        label = "global" if name == "global" else f"{name} (local)"
        if row.get("why_not"):
            notes.append(f"{label}: not scored: {row['why_not']}")
            table.append([label, *(f"[{len(notes)}]" for _ in sites), "-"])
            continue
        cells = row.get("cells") or {}
        line = [label, *(_cell(cells.get(s), notes, f"{label} on {s}") for s in sites)]
        acc = (row.get("weighted") or {}).get("accuracy")
        line.append(f"{acc:.4f}" if isinstance(acc, int | float) else "-")
        table.append(line)
    if len(doc.get("sites") or ()) > SHOWN_SITES:
        notes.append(f"{len(doc['sites']) - SHOWN_SITES} more sites (--json lists them)")
    return table, notes


def matrix_lines(doc: Mapping[str, Any] | None) -> list[str]:
    """Empty for a job without a matrix (yet)."""
    if not isinstance(doc, Mapping) or not doc.get("rows"):
        return []
    table, notes = matrix_rows(doc)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = [f"cross-site evaluation of job {doc.get('of_job')} (accuracy; rows: models, "
             "columns: the sites' held-out data):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in table]
    lines += [f"  [{i}] {n}" for i, n in enumerate(notes, 1)]
    return lines
