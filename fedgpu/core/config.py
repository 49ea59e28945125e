"""The job file, as earlier versions imported it: the job contract lives in fedgpu.core.job
(schema, strategy table, reader); import from there. Kept so code written against this module
(and code other branches are changing) still imports."""

from __future__ import annotations

from fedgpu.core.job import (
    MAX_GPU_MIB,
    MAX_JOB_FILE_BYTES,
    Job,
    Resources,
    Scalar,
    load_job,
    loads_toml,
    parse_job,
    with_bundle_task,
)

__all__ = ["MAX_GPU_MIB", "MAX_JOB_FILE_BYTES", "Job", "Resources", "Scalar", "load_job",
           "loads_toml", "parse_job", "with_bundle_task"]
