"""`mode = "cross-site"`: after a training job (`model_from_job`), its final (global) model and
each site's last local model of it are scored on every site's held-out split — a site x model
matrix (server/views/cross_site.py reads it from the round records).

Round 1 asks every connected site for its local model (TASK_KIND_LOCAL_MODEL): a site sends
the weights it kept after the last round it trained in that job (node/local_models.py), or
refuses with the reason (its policy's `share_local_model`, no model kept). Then one evaluate
round per model — each local model that came, by site name, then the global model — in
which every site scores it (server/rounds/scoring.py's round). Each record says what it is
in `cross_site`; the collection's lists the sites that sent and why the others did not.

Threat model: a site's local model reaches the aggregator and, as the payload of its scoring
round, every other site of the study (docs/how-to/cross-site-evaluation.md). Sending it is
the site's decision alone (fedgpu/core/site_policy.py local_model_refusal).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from fedgpu.core import codec
from fedgpu.core.job import Job
from fedgpu.proto import pb
from fedgpu.server.registry import Node
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.plans import Plan
from fedgpu.server.rounds.records import RoundRecord
from fedgpu.server.rounds.scoring import ScorePlan

log = logging.getLogger("fedgpu.server.rounds.engine")

KEY = "cross_site"  # what a round record of a cross-site job holds its part under
GLOBAL = "global"   # the matrix's name of the training job's final model
# Local models held at once on the aggregator (each a whole model in memory): sites past it
# are listed as not collected, with the reason.
MAX_LOCAL_MODELS = 32
NO_ANSWER = "no answer by the round deadline (round_deadline_s)"


class CollectPlan(Plan):
    """Round 1: every connected site is asked for its local model of the training job."""

    kind = pb.TASK_KIND_LOCAL_MODEL
    sends_model = False
    recorded = True

    def __init__(self, job: Job, spec: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        super().__init__(job)
        assert job.model_from_job is not None, "a cross-site job names its training job"
        self.of_job = job.model_from_job
        self.spec = {name: shape for name, (_, shape) in spec.items()}
        self.models: dict[str, dict[str, np.ndarray]] = {}
        self.not_sent: dict[str, str] = {}

    def attempts(self) -> int:
        return 1  # a refusal stays a refusal: what arrived by the deadline is the answer

    def pool_size(self) -> int:
        return self.job.min_available_nodes or self.job.min_nodes

    def choose(self, pool: list[Node], number: int, attempt: int) -> list[Node]:
        return pool

    def succeeded(self, rnd: RoundState) -> bool:
        return True  # no local model at all still leaves the global model's row

    def task_fields(self, number: int, attempt: int, chosen: list[Node]
                    ) -> list[dict[str, Any]]:
        return [{**f, "local_model_of": self.of_job}
                for f in super().task_fields(number, attempt, chosen)]

    def take_model(self, site: str, tensors: dict[str, np.ndarray]) -> None:
        """An accepted answer's weights (server/rounds/answers.py); kept if they fit."""
        got = {name: tuple(arr.shape) for name, arr in tensors.items()}
        if got != self.spec:
            self.not_sent[site] = (f"its local model does not fit job {self.of_job}'s model "
                                   "(other tensor names or shapes)")
        elif len(self.models) >= MAX_LOCAL_MODELS:
            self.not_sent[site] = (f"the aggregator compares at most {MAX_LOCAL_MODELS} "
                                   "local models per job")
        else:
            # Copies: the decoded arrays are views of the upload's buffer, which is reused.
            self.models[site] = {k: np.array(v) for k, v in tensors.items()}

    def closed(self, rnd: RoundState, record: RoundRecord | None, chosen: list[Node],
               ok: bool) -> str:
        reasons = dict(self.not_sent)
        reasons.update({f.node: f.error or "failed" for f in rnd.failures})
        reasons.update({i.node: i.reason for i in rnd.ineligible})
        reasons.update({r.node: r.message or r.reason for r in rnd.rejected if r.node})
        for node in chosen:
            if node.name not in self.models:
                reasons.setdefault(node.name, NO_ANSWER)
        self.not_sent = {k: v for k, v in reasons.items() if k not in self.models}
        if record is not None:
            record.extra[KEY] = {"stage": "collect", "of_job": self.of_job,
                                 "sent": sorted(self.models), "not_sent": self.not_sent}
        log.info("cross-site: local models of job %s from %s%s", self.of_job,
                 ", ".join(sorted(self.models)) or "no site",
                 "".join(f"; {site}: {why}" for site, why in sorted(self.not_sent.items())))
        return ""


class ModelScorePlan(ScorePlan):
    """One model of the matrix scored by every site (an evaluate job's round)."""

    def __init__(self, job: Job, model: str, number: int) -> None:
        super().__init__(job)
        self.model = model
        self.number = number

    @property
    def evaluated_round(self) -> int:
        return self.number  # the sites' metrics are this round's own (its record's `eval`)

    def closed(self, rnd: RoundState, record: RoundRecord | None, chosen: list[Node],
               ok: bool) -> str:
        if record is not None:
            record.extra[KEY] = {"stage": "score", "model": self.model}
        return super().closed(rnd, record, chosen, ok)


class CrossSitePlan(ScorePlan):
    """The job's plan: runs its rounds itself (`run_all`), the engine only commits the end."""

    runs_itself = True

    async def run_all(self, engine: Any) -> None:
        """Collect, then score each local model and the global model last (so the job's
        latest evaluation, its accuracy in `job list`, is the global model's); the engine's
        global model is the training job's final model again at the end, its one round done."""
        final = engine.global_weights
        assert final is not None
        collect = CollectPlan(self.job, codec.spec(final))
        collect.bind(engine)
        await engine._run_round(1, collect)
        number = 1
        for name, weights in [*sorted(collect.models.items()), (GLOBAL, final)]:
            number += 1
            engine.take_initial(weights)  # the model this round's tasks carry
            plan = ModelScorePlan(self.job, name, number)
            plan.bind(engine)
            await engine._run_round(number, plan)
        collect.models.clear()
        engine.global_round = 1
