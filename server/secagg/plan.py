"""Star training with secure aggregation: the engine's plan for it (server/rounds/plans.py).

Each attempt gets its own `SecAggRound`: the TRAIN tasks carry that round's Setup, the engine's
wait ends when the driver is done, and the attempt succeeded when at least `min_nodes` masked
updates are in the unmasked sum. The strategy (FedAvg, FedAvgM, FedAdam) sees one update: the
global model plus the unmasked weighted mean change, with the total weight.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fedgpu.core.job import Job
from fedgpu.core.secagg import layout
from fedgpu.core.secagg.aggregator import Outcome
from fedgpu.core.secagg.errors import SecAggError
from fedgpu.core.secagg.noise_share import NoiseShare
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds.attempt import RoundState, RunFailed
from fedgpu.server.rounds.intakes import Intake
from fedgpu.server.rounds.plans import StarPlan
from fedgpu.server.rounds.records import (
    EvalEntry,
    Resources,
    RoundRecord,
    UpdateRecord,
)
from fedgpu.server.rounds.states import SlotState
from fedgpu.server.secagg.driver import SecAggRound
from fedgpu.server.secagg.intake import SECAGG_KINDS, SecAggIntake
from fedgpu.server.strategies.private import PrivateStrategy
from fedgpu.server.strategies.update import UpdateIn


class SecAggPlan(StarPlan):
    def __init__(self, job: Job) -> None:
        super().__init__(job)
        assert job.secure_aggregation is not None
        self.config = job.secure_aggregation
        self.round: SecAggRound | None = None
        self._intake = SecAggIntake(self)

    def intake(self, kind: int) -> Intake | None:
        # Its messages, by either path, are this plan's to take (server/secagg/intake.py).
        return self._intake if kind in SECAGG_KINDS else None

    def task_fields(self, number: int, attempt: int, chosen: list[Node]
                    ) -> list[dict[str, Any]]:
        fields = super().task_fields(number, attempt, chosen)
        run: Any = self.run
        if self.round is not None:
            self.round.cancel()
        dp = self.strategy
        private = isinstance(dp, PrivateStrategy) and dp.distributed
        try:
            # A sum of fewer inputs than the round needs is never unmasked, in any mode: the
            # attempt fails before any unmask request goes out. Otherwise a retry's sum minus
            # this attempt's gives one site's update, and under distributed DP the attempt
            # would release a noised sum the account does not count.
            self.round = SecAggRound(self.config, chosen, run.shared_weights,
                                     self.job.max_examples_per_node,
                                     min_inputs=self.required(chosen), noised=private)
            # Its stage tasks are this job's (a site with --slots may hold another job's too).
            self.round.job_id = str(getattr(run, "job_id", ""))
        except SecAggError as exc:
            # Settings that cannot work for this round (too few sites, a sum that overflows).
            raise RunFailed(f"round {number}: secure aggregation cannot start: {exc}") from None
        if private:
            assert isinstance(dp, PrivateStrategy)
            p = self.round.params
            why = NoiseShare(dp.clip_norm, dp.noise_multiplier).range_problem(p.clip, p.threshold)
            if why is not None:
                raise RunFailed(f"round {number}: distributed DP cannot start: {why}")
        for node, f in zip(chosen, fields, strict=True):
            f["secagg_setup"] = self.round.setups[node.node_id]
            f["secagg_stage_timeout_s"] = self.config.stage_timeout_s
        return fields

    def describe(self, rnd: RoundState, chosen: list[Node]) -> str:
        assert self.round is not None
        p = self.round.params
        return (f"{super().describe(rnd, chosen)}; secure aggregation: threshold "
                f"{p.threshold}, {p.degree} neighbours each")

    def stop_waiting(self, rnd: RoundState, registry: Registry, now: float) -> bool:
        # The driver decides when the attempt is over (it sets rnd.done); it starts on the
        # engine's first look at the open attempt.
        sround = self.round
        if sround is not None and sround.task is None:
            sround.start(rnd, registry, lambda outcome: self._fold(rnd, outcome))
        return False

    async def _fold(self, rnd: RoundState, outcome: Outcome) -> None:
        """The unmasked mean into the strategy, and the counted sites' records."""
        run: Any = self.run
        sround = self.round
        assert sround is not None
        async with run._agg_lock:
            t0 = time.perf_counter()
            new = await asyncio.to_thread(layout.apply, run.shared_weights, outcome.mean)
            await asyncio.to_thread(run.strategy.add, UpdateIn(new, outcome.total_weight))
            if isinstance(run.strategy, PrivateStrategy) and run.strategy.distributed:
                run.strategy.secure_sum(sround.params.threshold, outcome.report.masked)
            rnd.aggregation_s += time.perf_counter() - t0
        for i, header in sorted(sround.headers.items()):
            node_id = sround.node_ids[i]
            node = run.registry.get(node_id)
            resources = Resources.from_wire(header.resources)
            rnd.updates.append(UpdateRecord(
                node_id=node_id, node=sround.names[i],
                # A site's example count stays with the site; the total is in the summary.
                num_examples=0,
                train_metrics=dict(header.train_metrics), eval_metrics=dict(header.eval_metrics),
                num_eval_examples=header.num_eval_examples, resources=resources,
                upload_s=rnd.upload_s.get(node_id),
                gpu_decision=node.decision if node is not None else {},
                transport=rnd.transport.get(node_id)))
            if node is not None:
                node.last_round = rnd.number
                node.rounds_completed += 1
                node.last_resources = resources.to_dict()
            rnd.slots[node_id] = SlotState.ACCEPTED

        self._attach_eval(outcome, sround)

    def _attach_eval(self, outcome: Outcome, sround: SecAggRound) -> None:
        """The sites' evaluation of the model they received, summed while masked: one entry
        for the sites together (no site's score is known)."""
        m = outcome.metrics
        n = m.get("num_eval_examples")
        scores = {k: float(m[f"eval_{k}"]["value"]) for k in ("loss", "accuracy")
                  if f"eval_{k}" in m}
        if n is None or not scores or not sround.headers:
            return
        run: Any = self.run
        evaluated = next(iter(sround.headers.values())).evaluated_round
        run.history.attach_eval(evaluated, EvalEntry(
            "", f"{n['sites']} sites (masked sum)", int(n["value"]), scores))

    def succeeded(self, rnd: RoundState) -> bool:
        sround = self.round
        return (sround is not None and sround.outcome is not None
                and sround.outcome.report.masked >= rnd.required)

    def closed(self, rnd: RoundState, record: RoundRecord | None, chosen: list[Node],
               ok: bool) -> str:
        sround = self.round
        if sround is not None:
            sround.cancel()
            if record is not None:
                record.extra["secure_aggregation"] = sround.summary()
                if sround.outcome is not None:
                    # Per-site numbers are secret: the round shows the sums that came out of
                    # the masked vector (the examples-weighted mean loss, total examples,
                    # steps, examples/s); under distributed DP the weight total only.
                    out = sround.outcome
                    sums = {k: v["value"] for k, v in out.metrics.items()}
                    record.num_examples = int(sums.get("examples", out.total_weight))
                    loss = sums.get("loss")
                    record.train_loss = None if loss is None else float(loss)
                    if out.metrics:
                        record.extra["masked_metrics"] = out.metrics
            if sround.failure is not None and rnd.error is None:
                rnd.error = f"round {rnd.number} attempt {rnd.attempt}: {sround.failure}"
                if record is not None:
                    record.error = rnd.error
        self.round = None
        return super().closed(rnd, record, chosen, ok)
