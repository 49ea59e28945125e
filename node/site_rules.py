"""The site's own policy at work in the agent: every task is checked against it before
anything runs (fedgpu/core/site_policy.py), a refusal is written to the site's audit log, and
the GPU time this site spent on each job is counted here for `max_gpu_hours`.

The node does not take the aggregator's word where it can see for itself: the task it would
run is the header's own task name and bundle (not the terms'), the round number is the
header's, a training task of a job that claims secure aggregation must carry the protocol's
setup, and GPU time is the node's own count. What only the aggregator knows (a job's study,
its central DP settings) is its word: a site that cannot trust it for those should not serve
that aggregator (docs/explanation/security.md).

GPU time per job lives in STATE/policy_usage/<job>.json (one small file per job, written to a
temporary name and renamed), so a restart of the node does not reset what a job has spent.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import re
from pathlib import Path

from fedgpu.core.audit import AuditError, AuditLog
from fedgpu.core.site_policy import SitePolicy
from fedgpu.core.site_policy_wire import terms_from_header
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node")

USAGE_DIR = "policy_usage"
_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class SiteRules:
    """One agent's view of its site's policy (None: the site set none; every task passes)."""

    def __init__(self, policy: SitePolicy | None, state_dir: Path, audit: AuditLog) -> None:
        self.policy = policy
        self.usage_dir = Path(state_dir) / USAGE_DIR
        self.audit = audit

    def refusals(self, header: pb.TaskHeader, kind: str,
                 now: dt.datetime | None = None) -> list[str]:
        """Why this site refuses the task ([]: it runs it); refusals are logged and audited."""
        if self.policy is None:
            return []
        terms = terms_from_header(header)
        if terms is None:
            reasons = ["the aggregator sent no job terms, and this site has a policy "
                       "(upgrade the aggregator)"]
        else:
            now = now or dt.datetime.now(dt.UTC)
            # max_rounds counts training rounds: a final evaluation (round rounds + 1) or a
            # cross-site job's scoring rounds train nothing.
            reasons = self.policy.refusals(terms, now, self.gpu_hours(terms.job_id),
                                           header.round if kind == "train" else 0)
            if (self.policy.require_secure_aggregation and kind == "train"
                    and not header.secagg_setup):
                # The terms claim secure aggregation; the task itself shows whether it is.
                reasons.append("the site requires secure aggregation and this training task "
                               "is a plain round")
            if self.policy.max_epsilon is not None and kind == "train":
                reasons += _noise_missing(header, terms.dp_mode)
            reasons = list(dict.fromkeys(reasons))
        if reasons:
            why = "; ".join(reasons)
            job = terms.job_id if terms is not None else "?"
            log.warning("round %d %s of job %s refused by the site policy: %s", header.round,
                        kind, job, why)
            try:
                self.audit.record(f"policy {self.policy.source}", "policy.refused",
                                  f"job {job} {header.task_name} round {header.round}",
                                  "REFUSED", why)
            except (OSError, AuditError) as exc:
                log.error("site audit log %s: %s", self.audit.path, exc)
        return reasons

    # ---- GPU time per job ---------------------------------------------------------------

    def _file(self, job_id: str) -> Path:
        name = job_id if _SAFE_ID.match(job_id) else hashlib.sha256(
            job_id.encode()).hexdigest()[:32]
        return self.usage_dir / f"{name or 'unnamed'}.json"

    def gpu_hours(self, job_id: str) -> float:
        try:
            doc = json.loads(self._file(job_id).read_text())
            return max(0.0, float(doc["gpu_seconds"])) / 3600
        except (OSError, ValueError, KeyError, TypeError):
            return 0.0

    def spent(self, header: pb.TaskHeader, resources: dict[str, object] | None) -> None:
        """Add a round's GPU time (its wall time on a GPU) to its job's count."""
        if self.policy is None or self.policy.max_gpu_hours is None or not resources:
            return
        if resources.get("device") != "cuda" or not header.HasField("job_terms"):
            return
        seconds = resources.get("round_seconds")
        if not isinstance(seconds, int | float) or seconds <= 0:
            return
        job_id = header.job_terms.job_id
        total = self.gpu_hours(job_id) * 3600 + float(seconds)
        path = self._file(job_id)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"job_id": job_id[:64], "gpu_seconds": total}))
            os.replace(tmp, path)
        except OSError as exc:
            log.error("cannot count GPU time of job %s in %s: %s", job_id, path, exc)


def _noise_missing(header: pb.TaskHeader, dp_mode: str) -> list[str]:
    """Local and distributed DP noise is added here, by the settings the task carries: a
    training task of such a job without them would upload an update with no noise."""
    if dp_mode == "local" and not header.HasField("privacy_local"):
        return ["the job claims local DP and this training task carries no noise settings"]
    if dp_mode == "distributed" and header.secagg_setup and not header.HasField(
            "privacy_distributed"):
        return ["the job claims distributed DP and this training task carries no noise "
                "settings"]
    return []
