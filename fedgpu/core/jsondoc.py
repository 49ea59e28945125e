"""Strict JSON for the `--json` documents: no NaN, no Infinity.

Python's json module writes float('nan') as `NaN`, which strict parsers (jq, JavaScript's
JSON.parse, Go, serde) refuse. Inputs are checked where they enter (metrics must be finite),
but a derived number can still overflow, so every document goes through `dumps`: a non-finite
number becomes null and the document says how many there were (`non_finite_values`).
"""

from __future__ import annotations

import json
import math
from typing import Any

COUNT_KEY = "non_finite_values"


def finite(value: Any) -> tuple[Any, int]:
    """`value` with every non-finite float replaced by None, and how many were replaced."""
    if isinstance(value, float):
        return (value, 0) if math.isfinite(value) else (None, 1)
    if isinstance(value, dict):
        out, bad = {}, 0
        for k, v in value.items():
            out[k], n = finite(v)
            bad += n
        return out, bad
    if isinstance(value, list | tuple):
        items, bad = [], 0
        for v in value:
            item, n = finite(v)
            items.append(item)
            bad += n
        return items, bad
    return value, 0


def dumps(doc: Any, **kwargs: Any) -> str:
    """One strict JSON document; a dict gains `non_finite_values` when any were replaced."""
    clean, bad = finite(doc)
    if bad and isinstance(clean, dict):
        clean[COUNT_KEY] = clean.get(COUNT_KEY, 0) + bad
    return json.dumps(clean, allow_nan=False, **kwargs)
