"""Admin list documents in pages that always fit in one gRPC message.

A run's history (or a registry of thousands of nodes) can outgrow the message limit, after
which `fedgpu rounds --json` would fail for the rest of the run. Each reply holds the items
from the requested offset that fit in PAGE_BYTES and says where the next page starts
(`next_offset`); fedgpu.core.admin_client joins the pages, so the CLI still prints one
document. An item that alone exceeds a page lists fewer of its entries and says how many it
left out (`<list>_not_listed`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fedgpu.core import jsondoc

# Well under the 17 MiB message limit (fedgpu.core.transport), with room for the envelope.
PAGE_BYTES = 8 << 20
# Lists an oversized item gives up entries of, in this order.
_SHRINKABLE = ("updates", "rejected", "failures")


def page(head: dict[str, Any], key: str, items: Sequence[dict[str, Any]], offset: int,
         budget: int = PAGE_BYTES) -> str:
    """The document `{**head, key: items[offset:...], "next_offset": n}` as strict JSON."""
    head, bad = jsondoc.finite(head)
    parts: list[str] = []
    size = len(json.dumps(head))
    next_offset = None
    for i in range(max(offset, 0), len(items)):
        item, n = jsondoc.finite(items[i])
        text = json.dumps(item, allow_nan=False)
        if len(text) > budget - size:
            if parts:
                next_offset = i
                break
            text = json.dumps(_shrunk(item, budget - size), allow_nan=False)
        parts.append(text)
        size += len(text) + 2
        bad += n
    fields = [json.dumps({k: v})[1:-1] for k, v in head.items()]
    fields.append(f'"{key}": [' + ", ".join(parts) + "]")
    if next_offset is not None:
        fields.append(f'"next_offset": {next_offset}')
    if bad:
        fields.append(f'"{jsondoc.COUNT_KEY}": {bad}')
    return "{" + ", ".join(fields) + "}"


def _shrunk(item: dict[str, Any], budget: int) -> dict[str, Any]:
    out = dict(item)
    for name in _SHRINKABLE:
        entries = out.get(name)
        if not isinstance(entries, list):
            continue
        keep = len(entries)
        while keep and len(json.dumps(out)) > budget:
            keep //= 2
            out[name] = entries[:keep]
            out[f"{name}_not_listed"] = len(entries) - keep
    return out
