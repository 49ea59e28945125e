"""A statistics round in the worker (`mode = "statistics"`): the task names its columns, the
worker summarises them (fedgpu/core/fedstats/columns.py) and writes the exact summaries to
result.json. The agent, not task code, then applies suppression and noise before anything
leaves the site (node/statistics_release.py).

The contract a task meets (built in for digits, images and causal-lm; a bundle's class may
define it too):

    def statistics(self, data_dir: Path, hparams: Mapping[str, Any]
                   ) -> list[tuple[ColumnSpec, numpy.ndarray]]

one (spec, values) pair per column: the spec fixes the range and bins every site bins on
(values outside are clamped), and how many values one record gives at most (`per_record`).
A task without it is refused with a one-line error naming the hook. No model is built.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedgpu.core.fedstats.columns import ColumnSpec, summarize, summary_to_dict
from fedgpu.core.fedstats.wire import MAX_COLUMNS

HOOK = "statistics"


class NoStatisticsError(ValueError):
    """The task has no statistics() hook (or it returned something else than columns)."""


def summaries(task: object, task_name: str, data_dir: Path, hparams: Mapping[str, Any]
              ) -> tuple[list[dict[str, object]], int, float]:
    """(the columns' exact summaries, the largest record count, seconds spent)."""
    started = time.perf_counter()
    hook = getattr(task, HOOK, None)
    if not callable(hook):
        raise NoStatisticsError(
            f"task {task_name!r} has no statistics() hook, so it cannot run a mode = "
            "\"statistics\" job; add `def statistics(self, data_dir, hparams)` returning "
            "[(ColumnSpec, values), ...] (see docs/how-to/statistics.md)")
    columns = hook(Path(data_dir), hparams)
    if not isinstance(columns, list | tuple) or not columns or len(columns) > MAX_COLUMNS:
        raise NoStatisticsError(f"task {task_name!r}: statistics() must return a list of 1 to "
                                f"{MAX_COLUMNS} (ColumnSpec, values) pairs")
    out: list[dict[str, object]] = []
    records = 0
    for item in columns:
        if (not isinstance(item, tuple) or len(item) != 2
                or not isinstance(item[0], ColumnSpec)):
            raise NoStatisticsError(f"task {task_name!r}: statistics() returned {item!r:.80}, "
                                    "not a (ColumnSpec, values) pair")
        spec, values = item
        arr = np.asarray(values)
        summary = summarize(spec, arr)
        records = max(records, int(summary.count) // spec.per_record)
        out.append(summary_to_dict(summary))
    if len({c["name"] for c in out}) != len(out):
        raise NoStatisticsError(f"task {task_name!r}: statistics() names a column twice")
    return out, records, time.perf_counter() - started
