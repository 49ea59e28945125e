"""`fedgpu rounds`: one line per secure-aggregation round under the table (what the
`secure_aggregation` object of `--json` says, in words)."""

from __future__ import annotations

from typing import Any


def lines(doc: dict[str, Any]) -> list[str]:
    out = []
    for r in doc.get("rounds", []):
        sa = r.get("secure_aggregation")
        if not sa:
            continue
        head = f"round {r['round']} attempt {r.get('attempt', 1)}, secure aggregation:"
        failed = sa.get("failed")
        if failed:
            out.append(f"{head} failed at {failed['stage']}: {failed['reason']}")
            continue
        dropped = "; ".join(f"{', '.join(names)} at {stage}"
                            for stage, names in (sa.get("dropped") or {}).items())
        out.append(f"{head} {sa.get('masked', 0)} of {sa['sites']} sites masked"
                   f"{', dropped ' + dropped if dropped else ''}"
                   f"{', ' + str(sa['recovered']) + ' recovered' if sa.get('recovered') else ''}"
                   f", protocol {sa.get('protocol_s', 0):.1f}s"
                   f"{sums(r.get('masked_metrics'))}")
    return out


def sums(metrics: dict[str, Any] | None) -> str:
    """`; sums of the masked metrics: 1,200 examples, 40 steps, 950.3 examples/s` (the
    training loss is the table's column), or "" when the round carried none."""
    parts = []
    for key, label, fmt in (("examples", "examples", "{:,.0f}"), ("steps", "steps", "{:,.0f}"),
                            ("examples_per_s", "examples/s", "{:,.1f}")):
        entry = (metrics or {}).get(key)
        if entry is not None:
            parts.append(f"{fmt.format(entry['value'])} {label}")
    return f"; sums of the masked metrics: {', '.join(parts)}" if parts else ""
