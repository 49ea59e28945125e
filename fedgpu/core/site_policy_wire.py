"""A job's terms (fedgpu/core/site_policy.py) to and from the TaskHeader: the aggregator writes
them, the node reads them, so both conversions live here, once."""

from __future__ import annotations

import math

from fedgpu.core.site_policy import MAX_NAME, JobTerms
from fedgpu.proto import pb


def terms_to_wire(terms: JobTerms) -> pb.JobTerms:
    return pb.JobTerms(job_id=terms.job_id, study=terms.study, rounds=terms.rounds,
                       secure_aggregation=terms.secure_aggregation, dp_mode=terms.dp_mode,
                       target_epsilon=terms.target_epsilon or 0.0)


def terms_from_header(header: pb.TaskHeader) -> JobTerms | None:
    """The terms a task came with (None: an aggregator that sends none). The task's own name
    and bundle come from the header itself: they are what the node would run."""
    if not header.HasField("job_terms"):
        return None
    t = header.job_terms
    eps = t.target_epsilon if math.isfinite(t.target_epsilon) and t.target_epsilon > 0 else None
    return JobTerms(job_id=t.job_id[:MAX_NAME], study=t.study[:MAX_NAME],
                    task=header.task_name,
                    bundle_sha256=header.bundle.sha256 if header.HasField("bundle") else "",
                    rounds=max(0, t.rounds), secure_aggregation=t.secure_aggregation,
                    dp_mode=t.dp_mode[:32], target_epsilon=eps)
