"""The JSON document a site sends with its statistics, and its reading on the aggregator.

A site's document is input from the network: it is read with limits (size, columns, bins) and
every number checked finite and in range, so a bad or hostile site gets a clear ValueError and
nothing of it reaches the combined figures.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fedgpu.core.fedstats.columns import ColumnSpec
from fedgpu.core.fedstats.release import ColumnRelease

VERSION = 1
MAX_DOC_BYTES = 1 << 20
MAX_COLUMNS = 256


def dumps(columns: list[ColumnRelease]) -> str:
    """The site's document; suppressed columns carry their spec and nothing else."""
    out: list[dict[str, Any]] = []
    for c in columns:
        doc: dict[str, Any] = {"name": c.spec.name, "lo": c.spec.lo, "hi": c.spec.hi,
                               "bins": c.spec.bins, "per_record": c.spec.per_record,
                               "suppressed": c.suppressed}
        if not c.suppressed:
            doc.update(count=c.count, sum=c.shifted_sum, sum_sq=c.shifted_sum_sq,
                       histogram=list(c.histogram))
        out.append(doc)
    text = json.dumps({"version": VERSION, "columns": out}, allow_nan=False)
    if len(text.encode()) > MAX_DOC_BYTES:
        raise ValueError(f"the statistics document is {len(text.encode())} bytes, over the "
                         f"{MAX_DOC_BYTES}-byte limit: fewer columns or bins")
    return text


def loads(text: str) -> list[ColumnRelease]:
    """A site's document read back; ValueError says what is wrong with it."""
    if len(text.encode()) > MAX_DOC_BYTES:
        raise ValueError(f"statistics document over {MAX_DOC_BYTES} bytes")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"statistics document is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"statistics document must be an object with version {VERSION}")
    cols = doc.get("columns")
    if not isinstance(cols, list) or len(cols) > MAX_COLUMNS:
        raise ValueError(f"statistics document needs a list of at most {MAX_COLUMNS} columns")
    out = [_column(c) for c in cols]
    names = [c.spec.name for c in out]
    if len(set(names)) != len(names):
        raise ValueError("statistics document names a column twice")
    return out


def _column(c: Any) -> ColumnRelease:
    if not isinstance(c, dict):
        raise ValueError("a statistics column must be an object")
    name = c.get("name")
    if not isinstance(name, str):
        raise ValueError("a statistics column needs a string name")
    spec = ColumnSpec(name=name, lo=_num(c, "lo", name), hi=_num(c, "hi", name),
                      bins=_int(c, "bins", name), per_record=_int(c, "per_record", name))
    suppressed = c.get("suppressed")
    if not isinstance(suppressed, bool):
        raise ValueError(f"column {name!r}: 'suppressed' must be true or false")
    if suppressed:
        return ColumnRelease(spec=spec, suppressed=True)
    hist = c.get("histogram")
    if not isinstance(hist, list) or len(hist) != spec.bins:
        raise ValueError(f"column {name!r}: histogram must list {spec.bins} cells")
    cells: list[float | None] = []
    for cell in hist:
        if cell is not None and not _nonneg(cell):
            raise ValueError(f"column {name!r}: a histogram cell must be a count >= 0 or null")
        cells.append(None if cell is None else float(cell))
    count, sum_sq = _num(c, "count", name), _num(c, "sum_sq", name)
    if count < 0 or sum_sq < 0:
        raise ValueError(f"column {name!r}: count and sum_sq must be >= 0")
    return ColumnRelease(spec=spec, suppressed=False, count=count,
                         shifted_sum=_num(c, "sum", name), shifted_sum_sq=sum_sq,
                         histogram=tuple(cells))


def _nonneg(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _num(c: dict[str, Any], key: str, name: str) -> float:
    v = c.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"column {name!r}: {key!r} must be a finite number")
    return float(v)


def _int(c: dict[str, Any], key: str, name: str) -> int:
    v = c.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"column {name!r}: {key!r} must be an integer")
    return v
