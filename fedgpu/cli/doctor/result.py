"""One check's result: the record every doctor module returns (a leaf: it imports none of them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
