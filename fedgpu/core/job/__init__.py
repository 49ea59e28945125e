"""The job contract: the job file's schema (job.py: every key declared once; schema.py: what a
key declares; sections.py: the sections and the rules across keys; resources.py:
`[resources]`), the strategy table (strategies.py) and the one reader of job files
(reader.py).

The names below are imported on first use (PEP 562): a feature's parser (secagg, privacy,
hetero) may read the strategy table without importing the whole schema, which imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Job": "job", "Scalar": "job", "parse_job": "job", "resume_keys": "job",
    "with_bundle_task": "job", "for_submission": "job", "Resources": "resources",
    "MAX_GPU_MIB": "resources",
    "MAX_JOB_FILE_BYTES": "reader", "JobFile": "reader", "load_job": "reader",
    "loads_toml": "reader", "read_job_file": "reader", "read_text": "reader",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
