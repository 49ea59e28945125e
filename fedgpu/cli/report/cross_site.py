"""`fedgpu report` for a cross-site job (mode = "cross-site"): the site x model matrix as a
markdown table in summary.md and as a heat map (cross_site.png), from the same round records
the aggregator's views read (fedgpu/core/cross_site_matrix.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedgpu.cli.common.cross_site_text import matrix_rows

PLOT = "cross_site.png"


def markdown(m: dict[str, Any]) -> list[str]:
    """The summary's section: the table, then the reasons of the cells marked [n]."""
    table, notes = matrix_rows(m)
    head, *rows = table
    return [
        "## Cross-site evaluation",
        "",
        f"Accuracy of each model of job {m.get('of_job')} (rows: the global model, then each "
        "site's local model) on each site's held-out data (columns).",
        "",
        "| " + " | ".join(c.replace("\\", "\\\\") for c in head) + " |",
        "|" + "---|" * len(head),
        *["| " + " | ".join(r) + " |" for r in rows],
        "",
        *[f"{i}. {n}" for i, n in enumerate(notes, 1)],
        "",
    ]


def plot(plt: Any, m: dict[str, Any], path: Path) -> None:
    """A heat map of the accuracies; a cell without a score is left blank."""
    sites = list(m.get("sites") or ())
    models = [r["model"] if r["model"] == "global" else f"{r['model']} (local)"
              for r in m["rows"]]
    grid = [[float("nan")] * len(sites) for _ in models]
    for i, row in enumerate(m["rows"]):
        for j, site in enumerate(sites):
            acc = ((row.get("cells") or {}).get(site) or {}).get("accuracy")
            if isinstance(acc, int | float):
                grid[i][j] = float(acc)
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * max(1, len(sites)), 1.2 + 0.5 * len(models)))
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(sites)), sites, rotation=30, ha="right")
    ax.set_yticks(range(len(models)), models)
    for i, line in enumerate(grid):
        for j, v in enumerate(line):
            if v == v:  # not NaN
                ax.text(j, i, f"{v:.3f}", ha="center", va="center",
                        color="white" if v < 0.6 else "black", fontsize=9)
    ax.set_xlabel("held-out data of site")
    ax.set_title("cross-site accuracy")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
