"""The header of each task a job's round hands a node: what to run (task, bundle, resources,
hyperparameters) and what the site's own policy checks of the job; its model's size and
digest when the task carries the global model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fedgpu.core import digests
from fedgpu.core.admission_wire import resources_to_wire
from fedgpu.core.bundles import BundleRef
from fedgpu.core.constants import GpuNeed
from fedgpu.core.job import Job
from fedgpu.core.site_policy import terms_of
from fedgpu.core.site_policy_wire import terms_to_wire
from fedgpu.proto import pb
from fedgpu.server.registry import Node
from fedgpu.server.rounds.link_admission import LinkAdmission
from fedgpu.server.rounds.plans import Plan
from fedgpu.server.rounds.work import task_hyperparameters
from fedgpu.server.transfer.payload import ModelPayload


class TaskHeaders:
    def __init__(self, job: Job, job_id: str, bundle: BundleRef | None,
                 links: LinkAdmission) -> None:
        self.job = job
        # Per-site hyperparameters (a slow link's compression) come from the link admission.
        self.links = links
        # What each site's own policy checks of the job (fedgpu/core/site_policy.py).
        self._terms = terms_to_wire(terms_of(job, job_id))
        # The task's bundle (None: installed on the nodes), named in every task header.
        self._bundle = (pb.TaskBundle(sha256=bundle.sha256, size=bundle.size, name=bundle.name,
                                      entry=bundle.entry, job_id=job_id)
                        if bundle is not None else None)

    def header(self, node: Node, task_id: str, number: int, plan: Plan, run_id: str,
               payload: ModelPayload | None, fields: Mapping[str, Any]) -> pb.TaskHeader:
        """Task `task_id` of round `number` for `node`; `fields` are the plan's own."""
        header = pb.TaskHeader(
            task_id=task_id,
            round=number,
            kind=plan.kind,
            task_name=self.job.task,
            hyperparameters_json=json.dumps(self.links.hyperparameters(
                node, task_hyperparameters(self.job, run_id), run_id)),
            use_gpu=self.job.needs.gpu is not GpuNeed.NONE,
            resources=resources_to_wire(self.job.needs),
            payload_size=payload.size if payload is not None else 0,
            evaluated_round=plan.evaluated_round,
            bundle=self._bundle,
            job_terms=self._terms,
            **fields,
        )
        if payload is not None:
            digests.stamp(header, payload.algorithm, payload.digest)
            header.payload_segment_digests = payload.segment_digests()
        return header
