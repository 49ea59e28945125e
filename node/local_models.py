"""The site's last local model of each training job it served, kept for cross-site evaluation
(`mode = "cross-site"`, server/rounds/cross_site.py).

After every training round the node served, the weights it trained (the file it uploads) are
kept as STATE/local_models/<job id>.safetensors with a note <job id>.json (the round, the
size), replacing the job's earlier round: one model per job. Only the newest KEEP_JOBS jobs
are kept (older ones are deleted when a newer job's model is written), and a model over the
size limit is not kept, only noted. On disk, so a restarted node still answers for its jobs.

A job whose update is not the plain model (compressed deltas, personalised layers left out),
or whose protection a local model would bypass (secure aggregation, differential privacy),
keeps a note with the reason instead: the site's answer to a
cross-site job says why it has no model. Its answer is given only when its policy lets the
model leave (fedgpu/core/site_policy.py local_model_refusal). safetensors, never pickle.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from fedgpu.core import local_params
from fedgpu.core.audit import AuditError, AuditLog
from fedgpu.core.site_policy import REFUSAL_PREFIX, SitePolicy, local_model_refusal
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node.local_models")

DIR = "local_models"
# The newest jobs whose local model a site keeps: a study compares a few recent jobs, and a
# model per job ever served would fill the disk.
KEEP_JOBS = 8
_JOB = re.compile(r"[A-Za-z0-9_-]{1,64}")  # names a file: nothing that walks out of the folder
_CODEC_KEYS = ("update_codec", "topk_fraction")


def not_plain(task: pb.TaskHeader) -> str | None:
    """Why the weights a training task uploads are not the site's plain local model."""
    if task.secagg_setup:
        return "the job trained under secure aggregation (no site's update is seen alone)"
    if task.HasField("privacy_local") or task.job_terms.dp_mode:
        # Its guarantee covers what leaves the sites: a local model sent on would bypass it.
        return (f"the job trained under differential privacy ([privacy] mode = "
                f"{task.job_terms.dp_mode or 'local'!r})")
    try:
        hparams = json.loads(task.hyperparameters_json or "{}")
    except ValueError:
        hparams = {}
    if isinstance(hparams, dict):
        if any(k in hparams for k in _CODEC_KEYS):
            return "the job's updates were compressed deltas (update_codec)"
        if hparams.get(local_params.HPARAM):
            return "the job keeps local_params (its update leaves the site's own layers out)"
    return None


class LocalModels:
    """One site's kept local models: `keep` after a training round, `answer` a cross-site task."""

    def __init__(self, state_dir: Path, max_bytes: int, audit: AuditLog | None = None,
                 asked_by: str = "", keep_jobs: int = KEEP_JOBS) -> None:
        self.folder = Path(state_dir) / DIR
        self.max_bytes = max_bytes
        self.keep_jobs = keep_jobs
        # The site's audit log: each local model that left the site, or was refused, and why.
        self.audit = audit
        self.asked_by = asked_by

    def _paths(self, job_id: str) -> tuple[Path, Path]:
        return self.folder / f"{job_id}.safetensors", self.folder / f"{job_id}.json"

    def keep(self, task: pb.TaskHeader, weights: Path | None) -> None:
        """After a training round of `task` that succeeded: keep `weights` as the job's local
        model (or the reason it is not kept). Never fails the round: a full disk is logged."""
        job_id = task.job_terms.job_id or task.bundle.job_id
        if not _JOB.fullmatch(job_id or ""):
            return  # an aggregator that names no job: nothing a cross-site job could ask for
        model, note = self._paths(job_id)
        why = not_plain(task)
        size = weights.stat().st_size if weights is not None and weights.exists() else 0
        if why is None and weights is None:
            why = "the round wrote no weights"
        if why is None and size > self.max_bytes:
            why = f"the model ({size} bytes) is over the node's limit of {self.max_bytes} bytes"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if why is None:
                assert weights is not None
                tmp = model.with_name(f".{model.name}.tmp")
                tmp.unlink(missing_ok=True)
                try:
                    os.link(weights, tmp)  # the round's file is removed after: no copy needed
                except OSError:
                    shutil.copyfile(weights, tmp)
                os.replace(tmp, model)
            else:
                model.unlink(missing_ok=True)
            doc = {"job_id": job_id, "round": task.round, "bytes": size if why is None else 0,
                   "kept_at": time.time(), "not_kept": why}
            tmp_note = note.with_name(f".{note.name}.tmp")
            tmp_note.write_text(json.dumps(doc) + "\n")
            os.replace(tmp_note, note)
            self._prune()
        except OSError as exc:
            log.error("could not keep the local model of job %s: %s", job_id, exc)

    def _prune(self) -> None:
        notes = sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime,
                       reverse=True)
        for old in notes[self.keep_jobs:]:
            self._paths(old.stem)[0].unlink(missing_ok=True)
            old.unlink(missing_ok=True)

    def find(self, job_id: str) -> tuple[Path | None, str]:
        """The kept model of `job_id`, or None and why there is none."""
        if not _JOB.fullmatch(job_id):
            return None, f"{job_id[:80]!r} is not a job id"
        model, note = self._paths(job_id)
        try:
            doc = json.loads(note.read_text())
        except (OSError, ValueError):
            return None, (f"this site kept no local model of job {job_id} (it trained in no "
                          f"round of it, or the job is older than its newest {self.keep_jobs})")
        if doc.get("not_kept"):
            return None, f"no local model of job {job_id} was kept: {doc['not_kept']}"
        if not model.exists():
            return None, f"the local model of job {job_id} is missing from {self.folder}"
        return model, ""

    def answer(self, task: pb.TaskHeader, node_id: str, policy: SitePolicy | None,
               refusals: list[str]) -> tuple[pb.UpdateHeader, Path | None]:
        """The answer to a TASK_KIND_LOCAL_MODEL task: the header, and the model to send
        (None: failed, the reason in the header's error). `refusals`: the site policy's
        reasons against the cross-site job itself (its study, its hours...)."""
        header = pb.UpdateHeader(node_id=node_id, task_id=task.task_id, round=task.round,
                                 kind=task.kind, evaluated_round=task.evaluated_round)
        refusal = (REFUSAL_PREFIX + "; ".join(refusals) if refusals
                   else local_model_refusal(policy))
        path, why = (None, refusal) if refusal else self.find(task.local_model_of)
        if path is None:
            header.failed = True
            header.error = why
            log.info("cross-site: local model of job %s not sent: %s", task.local_model_of, why)
        else:
            log.info("cross-site: sending the local model of job %s (%d bytes)",
                     task.local_model_of, path.stat().st_size)
        if self.audit is not None:
            try:
                self.audit.record(self.asked_by, "task.local_model",
                                  f"local model of job {task.local_model_of} ({task.task_id})",
                                  "REFUSED" if header.failed else "SENT", header.error or None)
            except (OSError, AuditError) as exc:
                log.error("site audit log %s: %s", self.audit.path, exc)
        return header, path
